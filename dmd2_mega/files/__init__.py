"""Writing files safely: the all-or-nothing write (`atomic`), whole outputs staged and renamed into place
(`staging`), one writer per directory (`dir_lock`), and no output over an input (`path_guard`)."""
