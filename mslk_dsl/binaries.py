"""Reading compiled kernels without a GPU or a DSL: cubins and AMD code objects.

* A cubin (ELF): its ``.nv.info`` attributes per kernel (registers, stack frame = local memory,
  required threads per block) and its ``.nv.shared.<kernel>`` section (static shared memory).
  The dynamic shared memory and block size of a CuTe launch are constants of the host code,
  read from the compiled host IR (LLVM dialect) by ``cute_launches``.
* A FlyDSL artifact.pkl: a pickled CompiledArtifact whose host MLIR embeds the code object
  (ELF). Its NT_AMDGPU_METADATA note (msgpack) gives VGPRs, AGPRs, SGPRs, spills, scratch, LDS
  and the work-group size; each kernel's descriptor (``<kernel>.kd``) gives the VGPRs the
  hardware allocates, which can exceed what the metadata counts.

Each reader returns one plain dict per kernel; mslk_dsl.resources builds reports on them.
"""
from __future__ import annotations

import math
import pickle
import re
import struct
import zlib

from mslk_dsl.errors import InputError

# -- ELF ----------------------------------------------------------------------------------------
SHT_SYMTAB, SHT_NOTE = 2, 7
NT_AMDGPU_METADATA = 32


def _elf_headers(data: bytes) -> list[dict]:
    """Every section header of a little-endian ELF64 file, by index, with its name."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise InputError("not an ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = []
    for i in range(shnum):
        name, kind, _, addr, offset, size, link, info, _, _ = struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
        headers.append({"name": name, "type": kind, "addr": addr, "offset": offset, "size": size, "link": link})
    names = headers[shstrndx]["offset"]
    for h in headers:
        h["name"] = _cstring(data, names + h["name"])
    return headers


def _elf_sections(data: bytes) -> dict[str, dict]:
    return {h["name"]: h for h in _elf_headers(data)}


def _section_bytes(data: bytes, header: dict) -> bytes:
    return data[header["offset"]:header["offset"] + header["size"]]


def _cstring(data: bytes, offset: int) -> str:
    return data[offset:data.index(b"\0", offset)].decode()


def _elf_symbols(data: bytes) -> list[tuple[str, int, int]]:
    """[(name, section index, value)] from .symtab, in symbol-index order."""
    headers = _elf_headers(data)
    symtab = next((h for h in headers if h["type"] == SHT_SYMTAB), None)
    if symtab is None:
        return []
    strtab = headers[symtab["link"]]["offset"]
    out = []
    for i in range(symtab["size"] // 24):
        st_name, _, _, st_shndx, st_value, _ = struct.unpack_from("<IBBHQQ", data, symtab["offset"] + 24 * i)
        out.append((_cstring(data, strtab + st_name), st_shndx, st_value))
    return out


# -- AMD code objects -----------------------------------------------------------------------------
def flydsl_code_objects(artifact_path: str) -> list[bytes]:
    """The code objects inside a FlyDSL artifact.pkl, read without importing flydsl.

    The artifact pickles a CompiledArtifact whose state holds ``ir_zlib`` (``ir_text`` before
    FlyDSL 0.4): the host MLIR, in which ``gpu.binary`` carries each code object as an MLIR string (``bin = "..."``)."""
    with open(artifact_path, "rb") as f:
        state = _StateOnly(f).load().state
    if "ir_zlib" in state:
        ir = zlib.decompress(state["ir_zlib"]).decode("latin-1")
    else:  # FlyDSL before 0.4 kept the text uncompressed
        ir = state["ir_text"]
    return [_mlir_string_bytes(m.group(1)) for m in re.finditer(r'\bbin = "((?:[^"\\]|\\.)*)"', ir)]


class _Stub:
    def __setstate__(self, state):
        self.state = state


class _StateOnly(pickle.Unpickler):
    """Unpickles any object as a stub keeping its state: no class of the pickle is imported."""

    def find_class(self, module, name):
        return _Stub


def _mlir_string_bytes(text: str) -> bytes:
    """Bytes of an MLIR string literal's body: ``\\XX`` is a hex byte, ``\\\\`` a backslash."""
    out = bytearray()
    i = 0
    while i < len(text):
        if text[i] != "\\":
            out.append(ord(text[i]))
            i += 1
        elif text[i + 1] in '\\"':
            out.append(ord(text[i + 1]))
            i += 2
        else:
            out.append(int(text[i + 1:i + 3], 16))
            i += 3
    return bytes(out)


def amdgpu_metadata(code_object: bytes) -> dict:
    """The NT_AMDGPU_METADATA note of a code object, decoded (msgpack)."""
    import msgpack

    for header in _elf_headers(code_object):
        if header["type"] != SHT_NOTE:
            continue
        p, end = header["offset"], header["offset"] + header["size"]
        while p + 12 <= end:
            namesz, descsz, note_type = struct.unpack_from("<III", code_object, p)
            p += 12
            name = code_object[p:p + namesz].rstrip(b"\0")
            p += (namesz + 3) & ~3
            desc = code_object[p:p + descsz]
            p += (descsz + 3) & ~3
            if name == b"AMDGPU" and note_type == NT_AMDGPU_METADATA:
                return msgpack.unpackb(desc)
    raise InputError("the code object has no AMDGPU metadata note")


def _kernel_descriptors(code_object: bytes) -> dict[str, dict]:
    """{symbol of a kernel descriptor (``name.kd``): what the hardware allocates for it}."""
    headers = _elf_headers(code_object)
    out = {}
    for name, shndx, value in _elf_symbols(code_object):
        if not name.endswith(".kd") or not 0 < shndx < len(headers):
            continue
        section = headers[shndx]
        start = section["offset"] + value - section["addr"]
        kd = code_object[start:start + 64]
        rsrc3, rsrc1 = struct.unpack_from("<II", kd, 44)
        out[name] = {"vgprs_allocated": ((rsrc1 & 0x3F) + 1) * 8,   # gfx90a+: granules of 8
                     "accum_offset": ((rsrc3 & 0x3F) + 1) * 4}
    return out


def amd_kernels(code_object: bytes) -> list[dict]:
    """One record per kernel of a code object (see module docstring)."""
    meta = amdgpu_metadata(code_object)
    descriptors = _kernel_descriptors(code_object)
    out = []
    for k in meta.get("amdhsa.kernels", []):
        reqd = k.get(".reqd_workgroup_size")
        record = {
            "name": k[".name"],
            "threads": math.prod(reqd) if reqd else None,
            "max_threads": k.get(".max_flat_workgroup_size"),
            "wavefront_size": k.get(".wavefront_size"),
            "vgprs": k.get(".vgpr_count", 0),
            "agprs": k.get(".agpr_count", 0),
            "sgprs": k.get(".sgpr_count", 0),
            "vgpr_spills": k.get(".vgpr_spill_count", 0),
            "sgpr_spills": k.get(".sgpr_spill_count", 0),
            "scratch_bytes": k.get(".private_segment_fixed_size", 0),
            "shared_bytes": k.get(".group_segment_fixed_size", 0),
        }
        record.update(descriptors.get(k.get(".symbol", ""), {}))
        out.append(record)
    return out


# -- cubins -------------------------------------------------------------------------------------
# .nv.info attributes (format byte 4 = a u16 size and that many bytes of value).
EIATTR_MAX_THREADS, EIATTR_REQNTID, EIATTR_FRAME_SIZE, EIATTR_REGCOUNT = 0x05, 0x10, 0x11, 0x2F
EIFMT_NVAL, EIFMT_BVAL, EIFMT_HVAL, EIFMT_SVAL = 1, 2, 3, 4
RESERVED_SHARED_BYTES = 1024  # per block, at the start of a kernel's .nv.shared section (sm_80+)


def _nv_info(blob: bytes) -> list[tuple[int, bytes | int | None]]:
    out: list[tuple[int, bytes | int | None]] = []
    p = 0
    while p + 2 <= len(blob):
        fmt, attr = blob[p], blob[p + 1]
        p += 2
        value: bytes | int | None
        if fmt == EIFMT_SVAL:
            size, = struct.unpack_from("<H", blob, p)
            value = blob[p + 2:p + 2 + size]
            p += 2 + size
        elif fmt == EIFMT_HVAL:
            value, = struct.unpack_from("<H", blob, p)
            p += 2
        elif fmt == EIFMT_BVAL:
            value = blob[p]
            p += 2  # a byte value is padded to a half-word
        else:
            value = None
        out.append((attr, value))
    return out


def cubin_kernels(cubin: bytes) -> list[dict]:
    """One record per kernel (entry function) of a cubin."""
    sections = _elf_sections(cubin)
    symbols = [name for name, _, _ in _elf_symbols(cubin)]
    per_symbol: dict[str, dict] = {}
    info = sections.get(".nv.info")
    for attr, value in _nv_info(_section_bytes(cubin, info)) if info else []:
        if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and isinstance(value, bytes) and len(value) == 8:
            index, amount = struct.unpack("<II", value)
            field = "registers" if attr == EIATTR_REGCOUNT else "scratch_bytes"
            per_symbol.setdefault(symbols[index], {})[field] = amount
    out = []
    for section, header in sorted(sections.items()):
        if not section.startswith(".nv.info."):
            continue
        name = section[len(".nv.info."):]
        record = {"name": name, "threads": None, "max_threads": None, "registers": 0, "scratch_bytes": 0,
                  **per_symbol.get(name, {})}
        for attr, value in _nv_info(_section_bytes(cubin, header)):
            if attr in (EIATTR_REQNTID, EIATTR_MAX_THREADS) and isinstance(value, bytes) and len(value) == 12:
                threads = math.prod(struct.unpack("<III", value))
                record["max_threads"] = threads
                if attr == EIATTR_REQNTID:
                    record["threads"] = threads
        shared = sections.get(f".nv.shared.{name}")
        # The section also spans the 1 KiB of shared memory the hardware reserves per block
        # (sm_80 and later), which is not the kernel's: on the H200 the driver reports 0 static
        # bytes for the kernels whose section is exactly 1024 (tools/gpu_resources.py).
        record["static_shared_bytes"] = max(0, shared["size"] - RESERVED_SHARED_BYTES) if shared else 0
        out.append(record)
    return out


# The CUDA launch config the DSL lowers into the host code: {grid, block, dynamic smem, ...}.
_LAUNCH_CONFIG = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"


def cute_launches(host_ir: str) -> dict[str, dict]:
    """{kernel name: {"threads", "dynamic_shared_bytes"}} from the compiled host IR (LLVM
    dialect), for the launches whose values are constants (None where they are not)."""
    out: dict[str, dict] = {}
    for body in re.split(r"\n\s*llvm\.func ", host_ir):
        constants = {m.group(1): int(m.group(2))
                     for m in re.finditer(r"(%\w+) = llvm\.mlir\.constant\((-?\d+) : i\d+\)", body)}
        configs = re.findall(r"(%\w+) = llvm\.alloca %\w+ x " + re.escape(_LAUNCH_CONFIG), body)
        kernels = re.findall(r"llvm\.mlir\.addressof @kernels_(\w+) : !llvm\.ptr\s*\n\s*%\w+ = llvm\.load[^\n]*\n"
                             r"\s*%\w+ = llvm\.call @_cudaLaunchKernelEx", body)
        for config, kernel in zip(configs, kernels):
            fields = {}
            for m in re.finditer(rf"(%\w+) = llvm\.getelementptr {re.escape(config)}\[0, ([\d, ]+)\]", body):
                stored = re.search(rf"llvm\.store (%\w+), {re.escape(m.group(1))} ", body)
                fields[m.group(2)] = constants.get(stored.group(1)) if stored else None
            block = [fields.get(f"1, {i}") for i in range(3)]
            out[kernel] = {"threads": math.prod(block) if None not in block else None,
                           "dynamic_shared_bytes": fields.get("2")}
    return out
