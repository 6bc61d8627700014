"""A missing data file is one line that says how to get it (issue 45, items 2 and 4): `fedhop run` from
a user's folder with no data exits 2 before any process starts, makes no run folder, and names the
command that fetches the set (`fedhop data fetch NAME --dir DIR`) or, for LEAF's sets, which have no
archive to fetch, the recipe that builds them; the user's own npz is checked the same way."""
from __future__ import annotations

import subprocess
import sys

import pytest

FEDHOP = [sys.executable, "-m", "fedhop.deploy.cli.cli"]


@pytest.mark.parametrize("sets, fix", [
    (["data.dataset=cifar10"], "fetch it with `fedhop data fetch cifar10 --dir {data}`"),
    (["data.dataset=cifar100"], "fetch it with `fedhop data fetch cifar100 --dir {data}`"),
    (["data.dataset=mnist"], "fetch it with `fedhop data fetch mnist --dir {data}`"),
    (["data.dataset=fashion_mnist", "data.data_dir=elsewhere"],
     "fetch it with `fedhop data fetch fashion_mnist --dir {here}/elsewhere`"),
    (["data.dataset=femnist"], "make them with LEAF's scripts: git clone https://github.com/TalwalkarLab/leaf && "
                               "cd leaf/data/femnist && ./preprocess.sh -s niid --sf 1.0 -k 0 -t sample, then copy "
                               "its data/train and data/test into {data}/femnist"),
    (["data.dataset=sent140"], "cd leaf/data/sent140 && ./preprocess.sh -s niid --sf 1.0 -k 3 -t sample"),
    (["data.dataset=npz"], "data.path: dataset 'npz' needs the path of an .npz file"),
    (["data.dataset=npz", "data.path=mine.npz"], "data.path = 'mine.npz': no such file"),
])
def test_a_missing_data_set_names_its_fix_in_one_line_and_starts_nothing(tmp_path, sets, fix):
    (tmp_path / "exp.toml").write_text("[run]\nrounds = 1\n")
    argv = [*FEDHOP, "run", "exp.toml", "--out", "runs/x"] + [a for s in sets for a in ("--set", s)]
    res = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1, res.stderr
    assert fix.format(data=tmp_path.resolve() / "data", here=tmp_path.resolve()) in res.stderr, res.stderr
    assert "docs/datasets.md" not in res.stderr            # a page a wheel user does not have
    assert not (tmp_path / "runs").exists()
