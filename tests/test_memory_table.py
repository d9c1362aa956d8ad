"""The measured-memory record of a distillation run and its table (`train/memory_record.py`,
`python -m dmd2_mega.eval.memory_table`): the peak is the per-phase maximum over cycles, the process RSS is the
kernel's high-water mark (in bytes, as /proc/self/status says), and the table reads <save>/memory.json
(a missing one is one line, exit status 2). The trainer's own record is checked in tests/test_lora_roles.py."""
from dmd2_mega.eval.memory_table import main
from dmd2_mega.train import memory_record
from dmd2_mega.train.memory_record import PeakResident, process_peak_rss


def test_the_peak_is_the_largest_cycle_per_phase_and_the_rss_a_high_water_mark():
    peak = PeakResident()
    assert peak.peak() == (None, 0)
    peak.update({"rollout": 10, "critic": 30, "actor": 20})
    peak.update({"rollout": 12, "critic": 25, "actor": 40})
    assert peak.per_phase == {"rollout": 12, "critic": 30, "actor": 40} and peak.peak() == ("actor", 40)
    # the two accounts are kept apart by the kernel (per-thread RSS counters are folded in lazily): a few % at most
    assert 0.95 * high_water_mark() <= process_peak_rss() <= 1.05 * high_water_mark()


def high_water_mark() -> int:
    """Bytes: the kernel's other account of the same peak, /proc/self/status VmHWM (kB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


def test_the_table_reads_each_runs_memory_file(tmp_path, capsys):
    full, lora = tmp_path / "full", tmp_path / "lora"
    for d, resident, trainable in ((full, 3 * 2**20, 1000), (lora, 2**20, 50)):
        d.mkdir()
        peak = PeakResident()
        peak.update({"rollout": resident // 2, "critic": resident})
        memory_record.write(str(d), peak.summary(trainable, "cpu"))
    assert main([f"full={full}", f"LoRA rank 4={lora}"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[2].startswith("| full | 1,000 | 3.00 | critic | 1.00x | ")
    assert rows[3].startswith("| LoRA rank 4 | 50 | 1.00 | critic | 0.33x | ")
    assert main([f"none={tmp_path / 'missing'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and "missing/memory.json: no such file" in err
