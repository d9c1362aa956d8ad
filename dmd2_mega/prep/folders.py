"""`--labels-from-folders`: an ImageNet-style folder tree -> the class names and the labelled image list.

    --media DIR/<class>/<image>      e.g. ImageNet's train/n01440764/n01440764_10026.JPEG (nested folders too)
    classes   the sorted names of DIR's subfolders (symlinks followed); an image's label is its class's index
    images    class by class; within a class, folders walked in sorted order, file names sorted; a file is an
              image when its lower-cased name ends in one of media.IMAGE_EXT
This is torchvision's `ImageFolder` convention (find_classes / make_dataset), which ADM-style ImageNet training
(DiT, SiT, DMD2's ImageNet runs) reads: image i here is ImageFolder's sample i, and ImageNet's sorted WordNet
ids give n01440764 (tench) label 0 of 1000. Only names are listed (os.scandir / os.walk, no file is opened):
the cost is O(files) paths in memory. Files directly in DIR and files of other extensions in a class folder
are left out and counted. A DataError naming --media (or --num-classes) for: no class subfolder, a class
folder without an image, a class count other than --num-classes.
"""
import os
from dataclasses import dataclass
from typing import List, Optional

from dmd2_mega.errors import DataError

from .clips import Clip
from .media import IMAGE_EXT


@dataclass(frozen=True)
class ClassFolders:
    classes: List[str]      # label i -> classes[i], the folder name
    clips: List[Clip]       # path relative to --media, label; in ImageFolder's order
    left_out: int           # files that are not an image of a class


def list_class_folders(media: str, num_classes: Optional[int] = None) -> ClassFolders:
    """The classes and images of the tree `media` (module docstring), checked against `num_classes` if given."""
    if not media or not os.path.isdir(media):
        raise DataError(f"--media {media}: not a directory (expected one subfolder of images per class)")
    with os.scandir(media) as it:
        entries = list(it)
    classes = sorted(e.name for e in entries if e.is_dir())
    left_out = len(entries) - len(classes)
    if not classes:
        raise DataError(f"--media {media}: no class subfolders (--labels-from-folders expects DIR/<class>/<image>, "
                        f"as ImageNet's train/n01440764/*.JPEG)")
    if num_classes is not None and len(classes) != num_classes:
        raise DataError(f"--num-classes {num_classes}: --media {media} has {len(classes)} class folders "
                        f"({classes[0]} ... {classes[-1]})")
    clips: List[Clip] = []
    for label, name in enumerate(classes):
        first = len(clips)
        for folder, _, files in sorted(os.walk(os.path.join(media, name), followlinks=True)):
            rel = os.path.relpath(folder, media)
            for f in sorted(files):
                if f.lower().endswith(IMAGE_EXT):
                    clips.append(Clip(os.path.join(rel, f), label=label))
                else:
                    left_out += 1
        if len(clips) == first:
            raise DataError(f"--media {media}: class folder {name}/ holds no image (expected files ending in "
                            f"{' '.join(IMAGE_EXT)}, any case)")
    return ClassFolders(classes, clips, left_out)
