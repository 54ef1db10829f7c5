"""kvlab's ctypes binding, read from the kernels' one header (``kvlab.h``): each ``KVLAB_API``
function's argument and result types, and a ``ctypes.Structure`` for each ``typedef struct``.
No signature is written again in Python.

The parser reads the small subset of C the header keeps to (its first comment lists it) and
fails on anything else with one line naming the header's line: a type it cannot map, a
declaration it cannot read, an ``#if`` whose branches it cannot follow. Every pointer to data
becomes ``c_void_p`` (callers pass a tensor's ``data_ptr()``, an address, or None for NULL); a
pointer to one of the header's structs becomes ``POINTER`` of its Structure (an array of them
passes as is).
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXPORT = "KVLAB_API"  # the header's mark on the functions the library exports to Python

SCALARS: dict[str, Any] = {
    "void": None, "int": ctypes.c_int, "long": ctypes.c_long, "float": ctypes.c_float,
    "double": ctypes.c_double, "size_t": ctypes.c_size_t, "char": ctypes.c_char,
    "int8_t": ctypes.c_int8, "uint8_t": ctypes.c_uint8, "int16_t": ctypes.c_int16,
    "uint16_t": ctypes.c_uint16, "int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32,
    "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64,
}
# the preprocessor lines it skips; any other (#if, #ifdef, ...) could hide a declaration from C
PREPROCESSOR = re.compile(r"#\s*(include|define|ifndef|endif)\b")
NAME = r"[A-Za-z_]\w*"
CONSTANT = re.compile(rf"#\s*define\s+(?P<name>KVLAB_\w+)\s+(?P<value>-?\d+)\b")  # integers Python reads too
FUNCTION = re.compile(rf"(?:(?P<export>{EXPORT})\s+)?(?P<ret>[\w\s*]+?)\s*\b(?P<name>{NAME})\s*\((?P<args>[^()]*)\)")
FUNCTION_POINTER = re.compile(rf"typedef\s+[\w\s*]+\(\s*\*\s*(?P<name>{NAME})\s*\)\s*\([^()]*\)")
STRUCT = re.compile(rf"typedef\s+struct\s*\{{(?P<body>[^{{}}]*)\}}\s*(?P<name>{NAME})")
DECLARATOR = re.compile(rf"(?P<type>[\w\s*]*?[\s*])(?P<name>{NAME})")


class HeaderError(ValueError):
    """kvlab.h holds something the binding cannot read or map."""


@dataclass(frozen=True)
class Function:
    name: str
    restype: Any  # a ctypes type, or None for void
    argtypes: tuple[Any, ...]
    line: int  # where the header declares it


@dataclass(frozen=True)
class Header:
    path: Path
    functions: dict[str, Function]  # the KVLAB_API ones, in the header's order
    internal: tuple[str, ...]  # the functions the .c files share among themselves only
    structs: dict[str, type[ctypes.Structure]]
    constants: dict[str, int]  # its `#define KVLAB_NAME <integer>` lines


def _statements(path: Path) -> list[tuple[int, str]]:
    """The header's declarations as (line, text), comments and the preprocessor lines gone."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", lambda m: re.sub(r"[^\n]", " ", m.group()), path.read_text(), flags=re.S)
    lines = []
    for number, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("#"):
            if not PREPROCESSOR.match(line.lstrip()):
                raise HeaderError(f"{path.name}:{number}: the binding does not follow `{line.strip()}`")
            line = ""
        lines.append(line)
    text = "\n".join(lines)
    statements, start, depth = [], 0, 0
    for i, c in enumerate(text):
        depth += {"{": 1, "}": -1}.get(c, 0)
        if c == ";" and depth == 0:
            statements.append((start, text[start:i]))
            start = i + 1
    if text[start:].strip():
        line = text.count("\n", 0, start + len(text[start:]) - len(text[start:].lstrip())) + 1
        raise HeaderError(f"{path.name}:{line}: the declaration has no closing `;`")
    out = []
    for at, s in statements:
        lead = len(s) - len(s.lstrip())
        out.append((text.count("\n", 0, at + lead) + 1, " ".join(s.split())))
    return [(line, s) for line, s in out if s]


def _ctype(decl: str, structs: dict[str, type[ctypes.Structure]], where: str, result: bool = False) -> Any:
    """The ctypes type of a C type such as ``const int64_t *`` (``void``: only as a result)."""
    stars = decl.count("*")
    words = [w for w in decl.replace("*", " ").split() if w != "const"]
    base = " ".join(words)
    if stars == 1 and base in structs:
        return ctypes.POINTER(structs[base])
    if base not in SCALARS and not (stars > 1 and base in structs):
        raise HeaderError(f"{where}: unknown C type `{decl.strip()}` (binding.py maps "
                          f"{', '.join(SCALARS)}, pointers to them and to the header's structs)")
    if stars:
        return ctypes.c_void_p
    if SCALARS[base] is None and not result:
        raise HeaderError(f"{where}: `void` is no argument's or field's type")
    return SCALARS[base]


def _struct(name: str, body: str, structs: dict[str, type[ctypes.Structure]], where: str) -> type[ctypes.Structure]:
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        first, *more = (d.strip() for d in decl.split(","))
        m = DECLARATOR.fullmatch(first)
        if m is None:
            raise HeaderError(f"{where}: cannot read the field `{decl}` of {name}")
        base = re.sub(r"\*.*", "", m["type"])  # `const void *w, *b`: the others share `const void`
        for d, declarator in [(m["type"], m["name"])] + [(base + re.sub(r"\w+$", "", x), re.sub(r"^[\s*]*", "", x))
                                                         for x in more]:
            if not re.fullmatch(NAME, declarator):
                raise HeaderError(f"{where}: cannot read the field `{decl}` of {name}")
            fields.append((declarator, _ctype(d, structs, f"{where}: field {name}.{declarator}")))
    return type(name, (ctypes.Structure,), {"_fields_": fields, "__doc__": f"kvlab.h's {name}."})


def parse(path: Path) -> Header:
    """Read a header in kvlab.h's subset of C (see its first comment)."""
    constants = {m["name"]: int(m["value"]) for m in CONSTANT.finditer(path.read_text())}
    functions: dict[str, Function] = {}
    internal: list[str] = []
    structs: dict[str, type[ctypes.Structure]] = {}
    seen: set[str] = set()
    for line, s in _statements(path):
        where = f"{path.name}:{line}"
        m = STRUCT.fullmatch(s) or FUNCTION_POINTER.fullmatch(s) or FUNCTION.fullmatch(s)
        if m is None or m.re is FUNCTION and ({"typedef", EXPORT} & set(m["ret"].split())):
            raise HeaderError(f"{where}: the binding cannot read `{s[:80]}`")
        if m["name"] in seen:
            raise HeaderError(f"{where}: {m['name']} is declared twice")
        seen.add(m["name"])
        if m.re is STRUCT:
            structs[m["name"]] = _struct(m["name"], m["body"], structs, where)
        elif m.re is FUNCTION_POINTER:
            pass  # a callback's type, for the .c files' own prototypes
        elif not m["export"]:
            internal.append(m["name"])  # its types are C's business only
        else:
            args = [] if m["args"].strip() == "void" else [a.strip() for a in m["args"].split(",")]
            types = []
            for a in args:
                d = DECLARATOR.fullmatch(a)
                if d is None or not d["type"].strip():
                    raise HeaderError(f"{where}: {m['name']}'s argument `{a}` needs a type and a name")
                types.append(_ctype(d["type"], structs, f"{where}: argument {d['name']} of {m['name']}"))
            restype = _ctype(m["ret"], structs, f"{where}: the result of {m['name']}", result=True)
            functions[m["name"]] = Function(m["name"], restype, tuple(types), line)
    return Header(path, functions, tuple(internal), structs, constants)


@functools.cache
def read(path: Path) -> Header:
    """``parse``, once per header: its Structure classes are the ones its pointer types point to."""
    return parse(path)


def bind(lib: ctypes.CDLL, header: Header) -> None:
    """Set argtypes and restype of each of the header's KVLAB_API functions on the loaded library
    (one it lacks: AttributeError, naming it)."""
    for f in header.functions.values():
        fn = getattr(lib, f.name)
        fn.argtypes, fn.restype = list(f.argtypes), f.restype
