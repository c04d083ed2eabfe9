"""scripts/bench_kernels_ab.py builds a git revision's C kernels beside this checkout's and runs both in one process."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ernie_serve.cpu_kernels import build

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))


@pytest.mark.skipif(not build.available(), reason="no C compiler: the kernels are not built")
def test_a_revisions_kernels_build_load_and_agree_with_this_checkouts(tmp_path, capsys):
    import bench_kernels_ab

    base = build.load(bench_kernels_ab.build_revision("HEAD", tmp_path), partial=True)
    base.ernie_set_num_threads(build.threads())
    assert base.ernie_threads() == build.threads()
    bench_kernels_ab.attention({"base": base, "new": build.library()}, rounds=1)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.endswith(("True", "False"))]
    assert len(rows) == 5 and all(line.endswith("True") for line in rows), rows  # HEAD's kernels: the same bits


@pytest.mark.skipif(not build.available(), reason="no C compiler: the kernels are not built")
def test_an_older_build_may_lack_functions_only_when_partial(tmp_path):
    """build.load(partial=True) declares what a library exports and skips the rest (an older revision's export
    list); without partial a missing function is an error, as library() needs them all."""
    src = tmp_path / "one.c"
    src.write_text("int ernie_threads(void) { return 7; }\n")
    out = tmp_path / "one.so"
    subprocess.run([build.compiler(), "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    assert build.load(out, partial=True).ernie_threads() == 7
    with pytest.raises(AttributeError):
        build.load(out)
