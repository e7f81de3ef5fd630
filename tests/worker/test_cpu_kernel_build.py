"""Where and when the worker's C++ kernels are built (``cpu_kernels.build_extension``), on a stand-in extension
of a few lines (a module with one constant, compiled in about a second) instead of the kernels themselves:
two source trees that differ get two builds and never rebuild each other's, identical trees share one, and a
compile error is reported as one line naming it.

A second load is checked in a fresh interpreter (as a second checkout's worker would load it): in one
process torch skips the build step of a module it has already loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.worker import cpu_kernels
from services.worker.cpu_kernels import KernelBuildError, build_extension

pytestmark = pytest.mark.skipif(subprocess.run(["sh", "-c", "command -v c++"], capture_output=True).returncode != 0, reason="no C++ compiler")

STAND_IN = """\
// A stand-in extension: a module with one constant, VALUE.
#include <Python.h>
#include "value.h"
#define CONCAT(a, b) a##b
#define INIT(name) CONCAT(PyInit_, name)
#define QUOTE(name) #name
#define STRING(name) QUOTE(name)
static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, STRING(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)(void) {
    PyObject* module = PyModule_Create(&module_def);
    if (module != nullptr) PyModule_AddIntConstant(module, "VALUE", VALUE);
    return module;
}
"""


def source_tree(directory: Path, value: int = 1, source: str = STAND_IN) -> tuple[list[Path], list[Path]]:
    directory.mkdir(parents=True)
    (directory / "stand_in.cpp").write_text(source)
    (directory / "value.h").write_text(f"#define VALUE {value}\n")
    return [directory / "stand_in.cpp"], [directory / "value.h"]


def build_state(build_dir: Path) -> dict[str, int | str]:
    """What a rebuild would change: the objects' and the module's mtimes, and ninja's log of what it ran."""
    state: dict[str, int | str] = {p.name: p.stat().st_mtime_ns for p in build_dir.iterdir() if p.suffix in (".o", ".so")}
    return {**state, ".ninja_log": (build_dir / ".ninja_log").read_text()}


def load_in_fresh_interpreter(name: str, tree: tuple[list[Path], list[Path]], root: Path) -> dict:
    script = (
        "import json, sys\nfrom pathlib import Path\nfrom services.worker.cpu_kernels import build_extension\n"
        "sources, headers, root = ([Path(p) for p in ps] for ps in json.loads(sys.argv[1]))\n"
        "module = build_extension(sys.argv[2], sources, headers, root=root[0])\n"
        "print(json.dumps({'file': module.__file__, 'value': module.VALUE}))\n"
    )
    argv = json.dumps([[str(p) for p in tree[0]], [str(p) for p in tree[1]], [str(root)]])
    done = subprocess.run([sys.executable, "-c", script, argv, name], capture_output=True, text=True, cwd=Path(__file__).parents[2], timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_different_sources_get_their_own_builds_and_do_not_rebuild_each_other(tmp_path: Path) -> None:
    root = tmp_path / "builds"
    tree_a = source_tree(tmp_path / "a", value=1)
    a = build_extension("different", *tree_a, root=root)
    b = build_extension("different", *source_tree(tmp_path / "b", value=2), root=root)  # only value.h differs
    assert (a.VALUE, b.VALUE) == (1, 2)  # both loaded in one process
    assert a.__name__ != b.__name__ and Path(a.__file__).parent != Path(b.__file__).parent
    before = build_state(Path(a.__file__).parent)

    again = load_in_fresh_interpreter("different", tree_a, root)

    assert again == {"file": a.__file__, "value": 1}
    assert build_state(Path(a.__file__).parent) == before  # nothing recompiled, nothing relinked


def test_identical_sources_in_two_trees_share_one_build(tmp_path: Path) -> None:
    root = tmp_path / "builds"
    first = build_extension("identical", *source_tree(tmp_path / "checkout-1"), root=root)
    before = build_state(Path(first.__file__).parent)

    second = load_in_fresh_interpreter("identical", source_tree(tmp_path / "checkout-2"), root)

    assert second == {"file": first.__file__, "value": 1}
    assert build_state(Path(first.__file__).parent) == before
    assert [p.name for p in root.iterdir()] == [Path(first.__file__).parent.name]


def test_the_compile_flags_are_part_of_the_key(tmp_path: Path) -> None:
    tree = source_tree(tmp_path / "a")
    plain = build_extension("flags", *tree, root=tmp_path / "builds")
    optimised = build_extension("flags", *tree, cflags=["-O1"], root=tmp_path / "builds")
    assert Path(plain.__file__).parent != Path(optimised.__file__).parent


def test_a_compile_error_is_one_line_naming_it_and_the_full_log(tmp_path: Path) -> None:
    broken = STAND_IN.replace("return module;", "return modul;")  # line 12
    sources, headers = source_tree(tmp_path / "broken", source=broken)

    with pytest.raises(KernelBuildError) as raised:
        build_extension("broken", sources, headers, root=tmp_path / "builds")

    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"{sources[0]}:12:")  # the checkout's file, not the build directory's copy
    assert "error: " in message and "modul" in message
    log_path = Path(message.rpartition("(full log: ")[2].rstrip(")"))
    assert log_path.is_file() and "modul" in log_path.read_text()


def test_the_worker_reports_a_failed_build_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources, headers = source_tree(tmp_path / "broken", source=STAND_IN.replace("#include <Python.h>", "#include <Python.h>\nint x = ;"))
    monkeypatch.setattr(cpu_kernels, "SOURCES", sources)
    monkeypatch.setattr(cpu_kernels, "HEADERS", headers)
    monkeypatch.setattr(cpu_kernels, "default_root", lambda: tmp_path / "builds")

    module, why = cpu_kernels.cpu_kernels.__wrapped__()

    assert module is None
    assert why.startswith(f"KernelBuildError: {sources[0]}:3:") and "error: " in why and "\n" not in why


def test_older_builds_of_a_name_are_removed_beyond_the_most_recent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "KEEP_BUILDS", 2)
    root = tmp_path / "builds"
    built = [Path(build_extension("pruned", *source_tree(tmp_path / f"v{v}", value=v), root=root).__file__).parent for v in range(3)]
    assert sorted(root.iterdir()) == sorted(built[1:])


def test_a_finished_build_loads_as_it_is_without_the_build_tools(tmp_path: Path) -> None:
    """As an image's read-only installation does: its build is loaded, not checked by ninja or written to."""
    root = tmp_path / "builds"
    tree = source_tree(tmp_path / "tree", value=7)
    build_dir = Path(build_extension("finished", *tree, root=root).__file__).parent
    (build_dir / "build.ninja").unlink()  # a load through torch's build step would write it again
    files = sorted(p.name for p in build_dir.iterdir())

    again = load_in_fresh_interpreter("finished", tree, root)

    assert again["value"] == 7 and Path(again["file"]).parent == build_dir
    assert sorted(p.name for p in build_dir.iterdir()) == files
