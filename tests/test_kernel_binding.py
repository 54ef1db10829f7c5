"""The C kernels declared once (``kvlab/kernels/kvlab.h``) and bound from that declaration
(``kvlab.kernels.binding``): the library exports exactly the header's functions, the structs'
ctypes layouts are C's, the .c files declare nothing a second time, and a header the binding
cannot read fails with its line."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from kvlab import kernels
from kvlab.kernels import binding


def header() -> binding.Header:
    return binding.read(kernels.HEADER)


def compiler() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


def test_the_library_exports_exactly_the_headers_functions():
    s = kernels.status()
    if not s.available:
        pytest.skip(s.detail)
    if shutil.which("nm") is None:
        pytest.skip("no nm")
    out = subprocess.run(["nm", "-D", "--defined-only", s.detail], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in out.stdout.splitlines() if line.split()[1] in "TtWi"}
    assert {name for name in exported if name.startswith("kvlab")} == set(header().functions)
    assert "kvlab_decoder_layers" in exported and not exported & set(header().internal)


def test_the_binding_calls_the_library_with_the_headers_types():
    """Each exported function carries the header's signature, so a wrong Python argument fails in
    ctypes instead of reaching C; the struct the stack passes is the header's."""
    lib = kernels._load()[0]
    if lib is None:
        pytest.skip(kernels.status().detail)
    for f in header().functions.values():
        fn = getattr(lib, f.name)
        assert (fn.argtypes, fn.restype) == (list(f.argtypes), f.restype), f.name
    with pytest.raises(ctypes.ArgumentError):
        lib.kvlab_rms_norm(0, None, None, 0, 0, 1, 8, "eps", 0, 1)  # a str where the header says float
    with pytest.raises(ctypes.ArgumentError):  # an array of another struct where kvlab_layer's is due
        lib.kvlab_decoder_layers((header().structs["kvlab_part"] * 1)(), None, None, 0, 0, 0, 0, 0, 0, 0, 0, 1)


def test_struct_layouts_are_cs(tmp_path):
    """Each struct's size and field offsets as ctypes lays them out from the header equal those a C
    compiler gives the same header."""
    structs = header().structs
    lines = [f'printf("{name} %zu\\n", sizeof({name}));' for name in structs]
    lines += [f'printf("{name}.{field} %zu\\n", offsetof({name}, {field}));'
              for name, s in structs.items() for field, _ in s._fields_]
    probe = tmp_path / "probe.c"
    probe.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "kvlab.h"\nint main(void) {\n'
                     + "\n".join(lines) + "\nreturn 0;\n}\n")
    subprocess.run([compiler(), "-I", str(kernels.HEADER.parent), str(probe), "-o", str(tmp_path / "probe")],
                   check=True, capture_output=True, text=True)
    c = dict(line.split() for line in subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True,
                                                      check=True).stdout.splitlines())
    py = {name: str(ctypes.sizeof(s)) for name, s in structs.items()}
    py |= {f"{name}.{field}": str(getattr(s, field).offset) for name, s in structs.items() for field, _ in s._fields_}
    assert {"kvlab_layer", "kvlab_part"} <= set(structs)
    assert py == c


def test_each_function_is_declared_once_in_kvlab_h(tmp_path):
    """Compiled as the library is, with C's warnings for a global function no header declares and
    for a declaration repeated: none; and the functions the objects define for the others are the
    header's, exported or shared."""
    cc = compiler()
    if shutil.which("nm") is None:
        pytest.skip("no nm")
    flags = [f for f in kernels.FLAGS if f not in ("-shared", "-O3")]
    defined = set()
    for src in kernels.SOURCES:
        obj = tmp_path / (src.stem + ".o")
        out = subprocess.run([cc, *flags, "-O0", "-c", "-Werror=missing-prototypes", "-Werror=redundant-decls",
                              str(src), "-o", str(obj)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        symbols = subprocess.run(["nm", "--defined-only", str(obj)], capture_output=True, text=True, check=True)
        defined |= {line.split()[-1] for line in symbols.stdout.splitlines() if line.split()[1] == "T"}
    assert defined == set(header().functions) | set(header().internal)


@pytest.mark.parametrize("text, line", [
    ("KVLAB_API void f(unsigned x);", 3),  # a type the binding does not map
    ("KVLAB_API void f(int x);\nKVLAB_API void g(my_t *x);", 4),
    ("typedef struct {\n    int a;\n    float b[4];\n} s;", 3),  # an array field
    ("#ifdef X\nKVLAB_API void f(int x);\n#endif", 3),  # a branch it cannot follow
    ("KVLAB_API void f(int);", 3),  # an argument without a name
    ("KVLAB_API void f(int x)", 3),  # no closing ;
    ("void f(int x);\nKVLAB_API void f(int x);", 4),
])
def test_a_header_the_binding_cannot_read_fails_naming_its_line(tmp_path, text, line):
    h = tmp_path / "bad.h"
    h.write_text(f"/* a header\n */\n{text}\n")
    with pytest.raises(binding.HeaderError) as e:
        binding.parse(h)
    message = str(e.value)
    assert message.startswith(f"bad.h:{line}: ") and "\n" not in message
