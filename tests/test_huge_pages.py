"""Commands that run graphs start again with glibc's huge-page tunable, where it changes something."""
import os
import subprocess
import sys
import textwrap

import pytest

from onnxgrad import cli, hugepages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables: Linux only")


@pytest.fixture
def madvise(tmp_path, monkeypatch):
    """A kernel whose transparent huge pages are in madvise mode, and glibc 2.36."""
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "_THP_MODE", str(mode))
    monkeypatch.setattr(hugepages.os, "confstr", lambda name: "glibc 2.36")
    return mode


def test_the_tunable_is_added_to_what_is_there(madvise):
    assert hugepages.huge_pages_env({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert hugepages.huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}


@pytest.mark.parametrize("env", [{"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}])
def test_a_tunable_the_user_set_is_kept(madvise, env):
    assert hugepages.huge_pages_env(env) is None


@pytest.mark.parametrize("mode, libc", [("always [madvise] never", "glibc 2.34"),
                                        ("[always] madvise never", "glibc 2.36"),
                                        ("always madvise [never]", "glibc 2.36"),
                                        ("always [madvise] never", "")])
def test_nothing_changes_where_the_tunable_would_do_nothing(madvise, monkeypatch, mode, libc):
    madvise.write_text(mode)
    monkeypatch.setattr(hugepages.os, "confstr", lambda name: libc)
    assert hugepages.huge_pages_env({}) is None


def test_nothing_changes_without_the_kernels_setting(madvise, tmp_path, monkeypatch):
    monkeypatch.setattr(hugepages, "_THP_MODE", str(tmp_path / "missing"))
    assert hugepages.huge_pages_env({}) is None


def test_the_process_starts_again_with_the_tunable_and_its_arguments(madvise):
    # the script runs twice in the same process: before the new start and after it, where the tunable is set
    script = textwrap.dedent(f"""
        import os, sys
        from onnxgrad import hugepages
        hugepages._THP_MODE = {str(madvise)!r}
        os.confstr = lambda name: "glibc 2.36"
        print("start", os.getpid(), sys.argv[1:], flush=True)
        hugepages.start_with_huge_pages()
        print("tunables", os.environ.get("GLIBC_TUNABLES"))
        """)
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", script, "a b", "c"], capture_output=True, text=True, env=env,
                         check=True).stdout.splitlines()
    pid = out[0].split()[1]
    assert out == [f"start {pid} ['a b', 'c']", f"start {pid} ['a b', 'c']", "tunables glibc.malloc.hugetlb=1"]


@pytest.mark.parametrize("args, starts_again", [(["run", "--help"], True), (["-q", "train", "--help"], True),
                                                (["check", "--help"], True), (["build-grad", "--help"], False),
                                                (["mirror", "--help"], False), (["--version"], False)])
def test_commands_that_run_graphs_start_again(monkeypatch, capsys, args, starts_again):
    calls = []
    monkeypatch.setattr(hugepages, "start_with_huge_pages", lambda: calls.append(1))
    monkeypatch.setattr(sys, "argv", ["onnxgrad", *args])
    assert cli.main() == 0
    assert calls == ([1] if starts_again else [])
    calls.clear()
    assert cli.main(args) == 0  # called with arguments (as a library or a test does): never
    assert calls == []


@pytest.mark.parametrize("command", sorted(cli.RUNS_GRAPHS))
def test_the_help_of_commands_that_start_again_says_how_to_keep_it_off(capsys, command):
    assert cli.main([command, "--help"]) == 0
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=0" in " ".join(capsys.readouterr().out.split())
