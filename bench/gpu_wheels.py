"""`python -m vitserve.bench.gpu_wheels --out .whl`: a folder of wheels that lets a GPU machine without network access
run vitserve on onnxruntime-gpu's CUDAExecutionProvider.

Why this exists: such a machine (here x86-64, H100 or H200 = sm_90, CPython 3.12, torch with NVIDIA's CUDA 13 /
cuDNN 9 pip libraries, onnxruntime CPU) cannot install from PyPI, and everything copied to it (the repository and the
wheels) is best kept small (`--max-mib`).
onnxruntime-gpu's wheel is ~245 MB, nearly all of it libonnxruntime_providers_cuda.so's `.nv_fatbin` section:
GPU code for sm_75, 80, 86, 89, 90 and 120. So this script:

1. downloads onnxruntime-gpu (cp312, manylinux x86-64) into a cache (build/gpu/wheel-cache), once;
2. slims it: drops the TensorRT provider library and the C API library (see `dropped`), and in every .so with a
   `.nv_fatbin` section zeroes, in place, the payload of each fatbin entry the H100 can never load (any
   architecture but sm_90). Offsets and sizes stay as they were (no ELF surgery: the host code's pointers into the
   section remain valid); zero runs compress to almost nothing in the wheel's zip. Optionally (on by default,
   `--keep-llm-kernels` turns it off) it also zeroes the sm_90 code of kernel groups that only LLM operators use
   (MoE, weight-only int4/int8 GEMM, beam search, decoding attention, ...) and relabels those entries so no device
   selects them: a ViT never launches them;
3. downloads the web stack the server needs and the GPU machine lacks (pinned below);
4. prints each wheel's size and the total, and exits 1 past `--max-mib`.

The fatbin layout (reverse-engineered publicly, e.g. from cuobjdump; checked here against onnxruntime-gpu 1.31.1):
a section holds containers back to back, each a 16-byte header (u32 magic 0xBA55ED50, u16 version, u16 header
size, u64 size of the entries that follow) and then entries, each an entry header (u16 kind: 1 PTX, 2 ELF/cubin;
u16 version; u32 header size (64, or 80/112 for sm_100+); u64 padded payload size; u32 compressed payload size
at +16; u32 sm arch at +28; u64 flags at +40, 0x8000 = zstd-compressed, 0x2000 = the older LZ4 one; u64 the
uncompressed size at +56) and its payload right after the header.

Where the CUDA driver picks code for a device, it takes the sm_90 SASS (a cubin for another major architecture
never runs on sm_90; PTX could be JIT-compiled, so a container without sm_90 SASS keeps its PTX of the highest
arch <= 90). onnxruntime-gpu 1.31.1 ships no PTX at all, so zeroing everything but sm_90 loses nothing on an H100.
"""
from __future__ import annotations

import argparse
import base64
import collections
import csv
import hashlib
import io
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ORT_PACKAGE = "onnxruntime-gpu"
ORT_VERSION = "1.31.1"  # the CUDA 13 build: libonnxruntime_providers_cuda.so needs libcudart.so.13, libcublas.so.13
CACHE = Path("build/gpu/wheel-cache")
KEEP_ARCH = 90  # H100 / H200: compute capability 9.0 (sm_90 and sm_90a SASS both carry arch 90)
# An arch no H100 can load (SASS of a newer major is never selected for an older device); the library already
# holds containers with only sm_120 code, so the runtime demonstrably copes with a container without sm_90 code.
UNLOADABLE_ARCH = 120

# pip's target for the GPU machine: CPython 3.12 on x86-64 glibc (manylinux_2_28 covers onnxruntime-gpu's wheel)
PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                 "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
                 "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]

# The web stack, pinned: resolved for cp312 from pyproject.toml's ranges (fastapi 0.165.x, uvicorn 0.54.x, ...).
# Left out because the GPU machine has them (and nothing here needs newer): numpy, pillow, prometheus-client,
# pyyaml, httpx (with httpcore, certifi, idna, sniffio), requests, psutil, uvloop, flatbuffers, packaging, sympy.
# Carried although it may be there: grpcio and protobuf, since the checked-in stubs (service/grpc/generated)
# refuse grpcio < 1.81.1 and protobuf < 6.33.5; anyio, h11, typing-extensions, click, small and required at
# versions that an older preinstalled copy may not meet (starlette 1.x, uvicorn 0.54, pydantic 2.14).
WEB_PINS = [
    "fastapi==0.165.0", "starlette==1.10.0", "annotated-doc==0.0.7", "uvicorn==0.54.0", "h11==0.16.0",
    "click==8.5.1", "httptools==0.9.0", "anyio==4.16.0", "typing-extensions==4.16.0",
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "pydantic-settings==2.16.3", "python-dotenv==1.2.4", "python-multipart==0.0.34", "fastapi-offline==1.7.7",
    "pyzmq==27.3.0", "msgspec==0.22.0", "grpcio==1.85.3", "protobuf==6.33.6",
    # tracing is opt-in (service/ground/tracing.py imports these lazily); api, sdk and semantic conventions are small
    "opentelemetry-api==1.45.2", "opentelemetry-sdk==1.45.2", "opentelemetry-semantic-conventions==0.66b2",
]

FATBIN_MAGICS = (0xBA55ED50, 0x466243B1)  # executable, relocatable
KIND_PTX, KIND_ELF, KIND_ELF_ALT = 1, 2, 0x10
FLAG_ZSTD, FLAG_LZ4 = 0x8000, 0x2000

# Kernel groups (one fatbin container = one .cu file's kernels) that only LLM operators launch. A container is
# dropped only when every kernel in it matches (cub's EmptyKernel, in every cub-using file, is ignored).
LLM_KERNEL_PATTERNS = [r"MoeFCGemm", r"fused_moe", r"[Mm]oe_", r"[Mm]oe[A-Z]", r"GroupProblemShape",
                       r"fpA_intB", r"llm.*kernels", r"BeamSearch", r"[Ss]ampling", r"masked_multihead_attention",
                       r"xqa", r"MatMulNBits", r"[Nn][Bb]its", r"[Dd]equantize.*[Bb]lockwise", r"ExpertMap",
                       r"finalizeMoe", r"[Ee]xpert"]


# ---------------------------------------------------------------------------------------------------- fatbin


@dataclass
class FatbinStats:
    containers: int = 0
    entries: collections.Counter = field(default_factory=collections.Counter)  # (kind, arch) -> count
    zeroed: collections.Counter = field(default_factory=collections.Counter)  # (kind, arch) -> count
    zeroed_bytes: int = 0
    llm_groups_dropped: int = 0
    llm_bytes: int = 0

    def merge(self, other: FatbinStats) -> None:
        self.containers += other.containers
        self.entries.update(other.entries)
        self.zeroed.update(other.zeroed)
        self.zeroed_bytes += other.zeroed_bytes
        self.llm_groups_dropped += other.llm_groups_dropped
        self.llm_bytes += other.llm_bytes


@dataclass
class Entry:
    offset: int  # of the entry header, in the buffer
    kind: int
    header_size: int
    padded_size: int
    data_size: int
    arch: int
    flags: int

    @property
    def payload(self) -> slice:
        # the whole padded payload: the padding is zeros already, so zeroing it all changes nothing else
        return slice(self.offset + self.header_size, self.offset + self.header_size + self.padded_size)


def parse_fatbin(buf, start: int, end: int) -> list[list[Entry]]:
    """The containers in buf[start:end], each a list of its entries. Raises ValueError on anything unexpected,
    so a layout change in a future CUDA is a loud failure rather than a silently corrupted library."""
    containers, pos = [], start
    while pos < end:
        if end - pos < 16:
            if any(buf[pos:end]):  # section padding is zeros; anything else we do not understand
                raise ValueError(f"{end - pos} trailing non-zero bytes at {pos:#x}")
            break
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", buf, pos)
        if magic not in FATBIN_MAGICS:
            if not any(buf[pos:pos + 16]):  # zero padding between containers (alignment): skip 8 bytes at a time
                pos += 8
                continue
            raise ValueError(f"no fatbin magic at {pos:#x}: {magic:#x}")
        entry_pos, container_end = pos + header_size, pos + header_size + fat_size
        if container_end > end:
            raise ValueError(f"container at {pos:#x} runs past the section ({container_end:#x} > {end:#x})")
        entries = []
        while entry_pos < container_end:
            kind, _ev, ehs, padded = struct.unpack_from("<HHIQ", buf, entry_pos)
            data_size, = struct.unpack_from("<I", buf, entry_pos + 16)
            arch, = struct.unpack_from("<I", buf, entry_pos + 28)
            flags, = struct.unpack_from("<Q", buf, entry_pos + 40)
            if ehs < 64 or entry_pos + ehs + padded > container_end:
                raise ValueError(f"bad entry at {entry_pos:#x}: header {ehs}, payload {padded}")
            entries.append(Entry(entry_pos, kind, ehs, padded, data_size, arch, flags))
            entry_pos += ehs + padded
        containers.append(entries)
        pos = container_end
    return containers


def zstd_decompress(data: bytes) -> bytes | None:
    """A cubin's bytes, to read its kernel names. The `zstd` command (Python 3.11 has no zstd module); None where
    it is missing, and the LLM-kernel pass then keeps everything."""
    try:
        import zstandard
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 30)
    except ImportError:
        pass
    if not shutil.which("zstd"):
        return None
    run = subprocess.run(["zstd", "-dcq"], input=data, capture_output=True)
    return run.stdout if run.returncode == 0 else None


def kernel_names(buf, entry: Entry) -> list[str] | None:
    """The kernels of one cubin entry, from its `.text.<mangled name>` section names; None when unreadable."""
    stored = bytes(buf[entry.payload][:entry.data_size or entry.padded_size])
    data: bytes | None = stored
    if entry.flags & FLAG_ZSTD:
        data = zstd_decompress(stored)
    elif entry.flags & FLAG_LZ4:
        return None
    if data is None:
        return None
    return [n.decode() for n in re.findall(rb"\.text\.([A-Za-z0-9_$.]+)", data)]


def is_llm_only(names: list[str] | None) -> bool:
    if not names:
        return False
    real = [n for n in names if "EmptyKernel" not in n]
    return bool(real) and all(any(re.search(p, n) for p in LLM_KERNEL_PATTERNS) for n in real)


def slim_fatbin(buf: bytearray, start: int = 0, end: int | None = None, keep_arch: int = KEEP_ARCH,
                drop_llm: bool = False) -> FatbinStats:
    """Zero, in place, each entry's payload that an sm_`keep_arch` device never loads. Per container: cubins
    (ELF) of arch `keep_arch` stay; PTX stays only where the container has no such cubin (the newest PTX with
    arch <= keep_arch, which the driver would JIT); everything else is zeroed. Headers, offsets and sizes are
    untouched. With `drop_llm`, a container whose kernels are all LLM-only has its kept cubins zeroed too and
    their arch set to UNLOADABLE_ARCH (the header field alone), so no device ever selects the zeros."""
    end = len(buf) if end is None else end
    stats = FatbinStats()
    for entries in parse_fatbin(buf, start, end):
        stats.containers += 1
        elf_kinds = (KIND_ELF, KIND_ELF_ALT)
        has_sass = any(e.kind in elf_kinds and e.arch == keep_arch for e in entries)
        ptx = [e for e in entries if e.kind == KIND_PTX and e.arch <= keep_arch]
        keep_ptx = None if has_sass or not ptx else max(ptx, key=lambda e: e.arch)
        keep = [e for e in entries if (e.kind in elf_kinds and e.arch == keep_arch) or e is keep_ptx]
        if drop_llm and keep and all(e.kind in elf_kinds for e in keep) \
                and all(is_llm_only(kernel_names(buf, e)) for e in keep):
            stats.llm_groups_dropped += 1
            for e in keep:
                stats.llm_bytes += e.padded_size
                struct.pack_into("<I", buf, e.offset + 28, UNLOADABLE_ARCH)
            zero = entries
        else:
            zero = [e for e in entries if not any(e is k for k in keep)]
        for e in entries:
            stats.entries[(e.kind, e.arch)] += 1
        for e in zero:
            stats.zeroed[(e.kind, e.arch)] += 1
            stats.zeroed_bytes += e.padded_size
            buf[e.payload] = bytes(e.padded_size)
    return stats


def elf_sections(buf) -> dict[str, tuple[int, int]]:
    """Name -> (file offset, size) of a little-endian ELF64 file's sections."""
    if buf[:4] != b"\x7fELF" or buf[4] != 2 or buf[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", buf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", buf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", buf, shoff + i * shentsize) for i in range(shnum)]
    strtab_off, strtab_size = headers[shstrndx][4], headers[shstrndx][5]
    strtab = bytes(buf[strtab_off:strtab_off + strtab_size])
    out = {}
    for name_off, sh_type, _flags, _addr, offset, size, *_ in headers:
        name = strtab[name_off:strtab.index(b"\0", name_off)].decode()
        if sh_type != 8:  # SHT_NOBITS has no bytes in the file
            out[name] = (offset, size)
    return out


def slim_elf(data: bytes, drop_llm: bool) -> tuple[bytes, FatbinStats | None]:
    """The .so with its `.nv_fatbin` slimmed (same length), or unchanged with None where it has none."""
    sections = elf_sections(data)
    if ".nv_fatbin" not in sections:
        return data, None
    offset, size = sections[".nv_fatbin"]
    buf = bytearray(data)
    stats = slim_fatbin(buf, offset, offset + size, drop_llm=drop_llm)
    assert len(buf) == len(data)
    return bytes(buf), stats


# ----------------------------------------------------------------------------------------------------- wheels


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def dropped(name: str, keep_capi: bool) -> bool:
    """Files the Python package never loads on the GPU machine. The TensorRT provider needs libnvinfer, which is
    not there. libonnxruntime.so.N is the C API library for C/C++ users: neither the Python binding
    (onnxruntime_pybind11_state.so, which holds the runtime itself) nor the CUDA provider (it reaches the runtime
    through libonnxruntime_providers_shared.so) lists it as NEEDED, and no .py file in the wheel names it;
    ~10.6 MiB of the slimmed wheel."""
    base = name.rsplit("/", 1)[-1]
    return base == "libonnxruntime_providers_tensorrt.so" or (
        not keep_capi and re.fullmatch(r"libonnxruntime\.so(\.[0-9]+)*", base) is not None)


def slim_wheel(src: Path, dst: Path, drop_llm: bool, compression: int = zipfile.ZIP_DEFLATED,
               keep_capi: bool = False) -> FatbinStats:
    """Rewrite the wheel: the TensorRT provider (and, unless keep_capi, the C API library) gone, every fatbin
    slimmed, RECORD regenerated (each file's sha256 and size, as pip checks on install), deflate at level 9."""
    total = FatbinStats()
    with zipfile.ZipFile(src) as zin:
        names = [n for n in zin.namelist() if not n.endswith("/")]
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        files: dict[str, bytes] = {}
        for name in names:
            if name == record:
                continue  # written anew below
            if dropped(name, keep_capi):
                print(f"  dropped {name}", flush=True)
                continue
            data = zin.read(name)
            if name.endswith(".so") or ".so." in name:
                data, stats = slim_elf(data, drop_llm)
                if stats:
                    print(f"  {name}: {fatbin_summary(stats)}", flush=True)
                    total.merge(stats)
            files[name] = data
    rows = [(n, record_hash(d), str(len(d))) for n, d in files.items()] + [(record, "", "")]
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    files[record] = text.getvalue().encode()
    tmp = dst.with_suffix(".tmp")
    # dist-info last, RECORD last of all, as wheel tools write them
    order = sorted(files, key=lambda n: (".dist-info/" in n, n == record, n))
    with zipfile.ZipFile(tmp, "w", compression=compression, compresslevel=9) as zout:
        for name in order:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))  # fixed: reproducible bytes
            info.compress_type = compression
            info.external_attr = (0o755 if name.endswith(".so") or ".so." in name else 0o644) << 16
            zout.writestr(info, files[name], compress_type=compression, compresslevel=9)
    tmp.replace(dst)
    return total


def fatbin_summary(stats: FatbinStats) -> str:
    kinds = {KIND_PTX: "ptx", KIND_ELF: "sm", KIND_ELF_ALT: "sm"}
    parts = [f"{kinds.get(k, f'kind{k}_')}{a}: {n} ({stats.zeroed[(k, a)]} zeroed)"
             for (k, a), n in sorted(stats.entries.items(), key=lambda x: (x[0][1], x[0][0]))]
    llm = f"; LLM-only sm_{KEEP_ARCH} groups dropped: {stats.llm_groups_dropped} " \
          f"({stats.llm_bytes / 2**20:.1f} MiB)" if stats.llm_groups_dropped else ""
    return f"{stats.containers} containers; " + ", ".join(parts) + \
        f"; {stats.zeroed_bytes / 2**20:.1f} MiB zeroed{llm}"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def cached(cache: Path, name: str, version: str) -> Path | None:
    prefix = f"{normalize(name)}-{version}-"
    return next((p for p in sorted(cache.glob("*.whl")) if normalize(p.name.split("-")[0]) + "-"
                 + p.name.split("-")[1] + "-" == prefix), None)


def download(spec: str, cache: Path) -> Path:
    """One wheel for the GPU machine, from the cache or `pip download` (no dependencies: the pins are complete)."""
    name, version = spec.split("==")
    hit = cached(cache, name, version)
    if hit:
        return hit
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *PLATFORM_ARGS, "-d", str(cache), spec]
    print("  " + " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    hit = cached(cache, name, version)
    if not hit:
        raise RuntimeError(f"pip downloaded no wheel for {spec} into {cache}")
    return hit


def needed_libs(data: bytes) -> list[str]:
    """An ELF64 file's DT_NEEDED libraries, from its .dynamic and .dynstr sections (what `readelf -d` shows)."""
    sections = elf_sections(data)
    dyn_off, dyn_size = sections[".dynamic"]
    str_off, str_size = sections[".dynstr"]
    out = []
    for i in range(0, dyn_size, 16):
        tag, val = struct.unpack_from("<qQ", data, dyn_off + i)
        if tag == 0:  # DT_NULL ends the table
            break
        if tag == 1:  # DT_NEEDED: an offset into .dynstr
            out.append(data[str_off + val:data.index(b"\0", str_off + val)].decode())
    return out


def check_cuda13(wheel: Path) -> str:
    """The provider library's CUDA major, from the libcudart.so.N it links (not from strings in its code:
    the library mentions libcudart.so.12 in a message, too)."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith("libonnxruntime_providers_cuda.so"))
        libs = needed_libs(z.read(name))
    found = sorted({m.group(1) for lib in libs if (m := re.fullmatch(r"libcudart\.so\.(\d+)", lib))})
    return ",".join(found) or "?"


def carry_wrk(wrk: Path, out: Path) -> None:
    """wrk and the one library it links that a CUDA image may lack (LuaJIT; OpenSSL 3 and glibc are there):
    bench/gpu-offline.sh puts OUT/bin on PATH and OUT/lib on the loader's path."""
    (out / "bin").mkdir(exist_ok=True)
    (out / "lib").mkdir(exist_ok=True)
    shutil.copy2(wrk, out / "bin" / "wrk")
    ldd = subprocess.run(["ldd", str(wrk)], capture_output=True, text=True, check=True).stdout
    for line in ldd.splitlines():
        if "libluajit" in line and "=>" in line:
            library = Path(line.split("=>")[1].split("(")[0].strip())
            shutil.copy2(library.resolve(), out / "lib" / library.name)
    print(f"wrk: {wrk} and its libluajit into {out}/bin, {out}/lib", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m vitserve.bench.gpu_wheels")
    ap.add_argument("--out", type=Path, default=Path(".whl"), help="the folder of wheels to carry (emptied first)")
    ap.add_argument("--cache", type=Path, default=CACHE, help="downloaded wheels, kept between runs")
    ap.add_argument("--seed", type=Path, action="append", default=[],
                    help="a folder whose wheels are copied into the cache first (a download made elsewhere)")
    ap.add_argument("--ort-version", default=ORT_VERSION)
    ap.add_argument("--keep-llm-kernels", action="store_true",
                    help="keep the sm_90 code of LLM-only kernel groups (MoE, int4 GEMM, beam search, ...)")
    ap.add_argument("--keep-capi-lib", action="store_true",
                    help="keep libonnxruntime.so.N (the C API library; the Python package does not load it)")
    ap.add_argument("--no-web", action="store_true", help="onnxruntime-gpu alone")
    ap.add_argument("--lzma", action="store_true",
                    help="LZMA zip members instead of deflate: smaller, read by pip's zipfile, but non-standard")
    ap.add_argument("--leave-out", action="append", default=[], metavar="NAME",
                    help="a web-stack package not to carry (e.g. grpcio, 7 MiB, where the kit serves without gRPC)")
    ap.add_argument("--wrk", default=shutil.which("wrk") or "",
                    help="the load generator to carry, with its libluajit, into OUT/bin and OUT/lib (default: wrk "
                         "on PATH; Debian's package)")
    ap.add_argument("--max-mib", type=float, default=40.0)
    args = ap.parse_args(argv)

    args.cache.mkdir(parents=True, exist_ok=True)
    for folder in args.seed:
        for whl in folder.glob("*.whl"):
            if not (args.cache / whl.name).exists():
                shutil.copy2(whl, args.cache / whl.name)
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)

    print(f"{ORT_PACKAGE}=={args.ort_version}", flush=True)
    ort = download(f"{ORT_PACKAGE}=={args.ort_version}", args.cache)
    cuda = check_cuda13(ort)
    print(f"  {ort.name}: {ort.stat().st_size / 2**20:.1f} MiB, links libcudart.so.{cuda}", flush=True)
    if cuda != "13":
        print(f"  warning: not a CUDA 13 build (libcudart.so.{cuda}); the GPU machine's torch brings CUDA 13")
    stats = slim_wheel(ort, args.out / ort.name, drop_llm=not args.keep_llm_kernels,
                       compression=zipfile.ZIP_LZMA if args.lzma else zipfile.ZIP_DEFLATED,
                       keep_capi=args.keep_capi_lib)
    if stats.entries[(KIND_ELF, KEEP_ARCH)] == 0:
        print(f"error: no sm_{KEEP_ARCH} cubin in the fatbins: the slimmed library would run nothing on an H100")
        return 1
    if not args.no_web:
        print("web stack", flush=True)
        left_out = {normalize(name) for name in args.leave_out}
        for spec in WEB_PINS:
            if normalize(spec.split("==")[0]) not in left_out:
                shutil.copy2(download(spec, args.cache), args.out)
    if args.wrk:
        carry_wrk(Path(args.wrk), args.out)

    rows = sorted(((p.name, p.stat().st_size) for p in args.out.glob("*.whl")), key=lambda r: -r[1])
    total = sum(size for _, size in rows)
    width = max(len(n) for n, _ in rows)
    print(f"\n{'wheel':<{width}}  {'MiB':>7}")
    for name, size in rows:
        print(f"{name:<{width}}  {size / 2**20:7.2f}")
    print(f"{'total':<{width}}  {total / 2**20:7.2f}  (limit {args.max_mib:g})")
    if total > args.max_mib * 2**20:
        print(f"error: {total / 2**20:.1f} MiB is over --max-mib {args.max_mib:g}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
