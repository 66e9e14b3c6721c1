"""Hardware profiles for the roofline pass-cost model: peak rates from datasheets, achieved-efficiency factors from
public profiling, and a `cpu` profile measured on the local machine.

Units: FLOP/s, bytes/s, bytes, seconds. All peak tensor rates are *dense* (NVIDIA datasheets print the 2:4-sparse
figure first; dense = half of it). NVLink is the per-GPU total bidirectional figure NVIDIA prints; one direction is
half of it, and the collective model uses an achieved *bus* bandwidth instead (see `Efficiency`).

We could not browse while writing this: every number is quoted from the public datasheet named beside it as we
know it; the ones marked "uncertain" differ between NVIDIA documents (SXM vs HGX vs NVL72 configurations, or
preliminary vs final specs) and should be checked against the datasheet before relying on them.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace

#: placeholder prices, US$ per GPU-hour, that `dblock simulate plan` uses unless `--price KIND=USD` says otherwise
#: (here, not in plan.py, so that building the CLI parser imports no numpy)
PRICES = {"h100": 2.50, "h200": 3.50, "b200": 5.50, "gb300": 8.00, "a100": 1.50, "h800": 2.50, "h20": 1.20,
          "l4": 0.80, "rtx3090": 0.30}

TB = 1e12
GB = 1e9


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak and latency floors (from public profiling; see the per-GPU comments).

    gemm:        large bf16 GEMM FLOP/s / peak                   (cuBLAS on big square-ish shapes)
    stream:      achieved HBM bandwidth / peak                   (STREAM-like copy/triad)
    gemm_knee_rows: rows below which a GEMM tile is mostly padding: a grouped expert GEMM with m rows per expert
                 runs as if it had max(m, knee) rows of compute (tile quantization on the M dimension)
    launch_s:    floor of any single kernel (launch + tail), s
    a2a_latency_s / allreduce_latency_s: small-message floor of one all-to-all / all-reduce in the TP/EP group, s
    a2a_busbw / allreduce_busbw: achieved bus bandwidth for large messages, bytes/s (nccl-tests' "busbw")
    """

    gemm: float = 0.7
    stream: float = 0.85
    gemm_knee_rows: int = 64
    launch_s: float = 4e-6
    a2a_latency_s: float = 30e-6
    allreduce_latency_s: float = 15e-6
    a2a_busbw: float = 150 * GB
    allreduce_busbw: float = 350 * GB


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_flops: float           # dense BF16 tensor FLOP/s
    fp8_flops: float | None     # dense FP8 tensor FLOP/s (None: no FP8 tensor cores)
    fp4_flops: float | None     # dense FP4 tensor FLOP/s (None: no FP4 tensor cores)
    hbm_bw: float               # bytes/s
    hbm_bytes: float            # capacity, bytes
    nvlink_bw: float            # per-GPU total bidirectional NVLink, bytes/s (0: none)
    eff: Efficiency = field(default_factory=Efficiency)
    source: str = ""

    def flops(self, dtype: str = "bf16") -> float:
        rates = {"bf16": self.bf16_flops, "fp16": self.bf16_flops, "fp8": self.fp8_flops, "fp4": self.fp4_flops}
        v = rates.get(dtype)
        if v is None:
            have = ", ".join(k for k, x in rates.items() if x)
            raise ValueError(f"{self.name}: no {dtype} tensor rate (allowed: {have})")
        return v

    def with_efficiency(self, **kw) -> "Hardware":
        return replace(self, eff=replace(self.eff, **kw))

    def as_dict(self) -> dict:
        return asdict(self)


# ---- efficiency factors (public profiling data, approximate) ----------------------------------------------------
# Hopper (H100/H200):
#   gemm 0.70: cuBLAS bf16 GEMMs at 8192^3 reach ~650-750 TFLOP/s on H100 SXM (NVIDIA "Hopper tuning guide"/
#       public microbenchmarks, e.g. the "H100 GEMM" plots of Lambda and of the DeepGEMM README comparisons); 0.7 of
#       989 TFLOP/s. Approximate.
#   stream 0.85-0.9: STREAM/copy kernels reach ~2.9-3.0 TB/s of the 3.35 TB/s on H100 SXM (public microbenchmarks,
#       e.g. Chips and Cheese "Nvidia's H100: Funny L2, and Tons of Bandwidth"). Approximate.
#   a2a: DeepEP README (H800, NVLink intranode, normal kernels): ~153-158 GB/s dispatch/combine bandwidth per GPU;
#       its low-latency kernels ~ tens of microseconds at small batch. H100 NVLink = H800's NVLink x2 (900 vs
#       400 GB/s), so 150 GB/s is conservative for H100. Latency floor 30 us: uncertain (order of magnitude).
#   all-reduce: nccl-tests all_reduce_perf on 8xH100 SXM (NVSwitch) reports busbw ~ 350-480 GB/s for large
#       messages and ~10-20 us for small ones (NVIDIA NCCL performance blog posts / nccl-tests READMEs). Approximate.
#   gemm_knee_rows 16: vLLM's fused_moe default Triton config uses BLOCK_SIZE_M = 16 when the token count is small
#       (M <= E) and 64 above (fused_moe.py get_default_config); a touched expert pays at least one 16-row tile.
HOPPER_EFF = Efficiency(gemm=0.70, stream=0.88, gemm_knee_rows=16, launch_s=4e-6, a2a_latency_s=30e-6,
                        allreduce_latency_s=15e-6, a2a_busbw=150 * GB, allreduce_busbw=360 * GB)
# Ampere A100: cuBLAS bf16 ~ 250-270 of 312 TFLOP/s (~0.8; NVIDIA A100 whitepaper / MLPerf-era microbenchmarks);
#   STREAM ~1.7-1.8 of 2.04 TB/s; nccl-tests 8xA100 NVSwitch all-reduce busbw ~ 230 GB/s. Approximate.
AMPERE_EFF = Efficiency(gemm=0.80, stream=0.85, gemm_knee_rows=16, launch_s=5e-6, a2a_latency_s=35e-6,
                        allreduce_latency_s=20e-6, a2a_busbw=100 * GB, allreduce_busbw=230 * GB)
# Blackwell (B200/GB300): no comparably settled public profiling when written; we assume Hopper-like fractions
#   and NVLink-5 bus bandwidth scaled by the 2x link rate. Uncertain.
BLACKWELL_EFF = Efficiency(gemm=0.70, stream=0.85, gemm_knee_rows=16, launch_s=4e-6, a2a_latency_s=30e-6,
                           allreduce_latency_s=15e-6, a2a_busbw=300 * GB, allreduce_busbw=700 * GB)
# H800: Hopper with NVLink cut to 400 GB/s; DeepEP's README measures its intranode normal kernels on H800 at
#   ~153-158 GB/s dispatch/combine (the a2a figure above); all-reduce busbw scaled by the NVLink ratio. Approximate.
H800_EFF = replace(HOPPER_EFF, allreduce_busbw=170 * GB)
# PCIe cards without NVLink (the RTX 3090 as Diffulex profiled it, the L4): collectives cross PCIe Gen4 x16
#   (32 GB/s per direction); nccl-tests all-reduce on 4 PCIe GPUs reaches ~10-12 GB/s busbw with ~30-50 us small-
#   message latency (public nccl-tests reports). Approximate.
PCIE_EFF = Efficiency(gemm=0.70, stream=0.85, gemm_knee_rows=16, launch_s=5e-6, a2a_latency_s=50e-6,
                      allreduce_latency_s=40e-6, a2a_busbw=10 * GB, allreduce_busbw=11 * GB)


PROFILES: dict[str, Hardware] = {
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM5): BF16 1,979 TFLOPS with sparsity = 989.4 dense;
    # FP8 3,958 sparse = 1,979 dense; no FP4; HBM3 80 GB at 3.35 TB/s; NVLink 900 GB/s.
    "h100": Hardware("H100 SXM5 80GB", 989.4 * TB, 1979 * TB, None, 3.35 * TB, 80 * GB, 900 * GB, HOPPER_EFF,
                     "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): same tensor rates as H100 SXM (BF16 989 dense, FP8 1,979
    # dense); HBM3e 141 GB at 4.8 TB/s; NVLink 900 GB/s.
    "h200": Hardware("H200 SXM 141GB", 989.4 * TB, 1979 * TB, None, 4.8 * TB, 141 * GB, 900 * GB, HOPPER_EFF,
                     "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    # NVIDIA DGX B200 / HGX B200 datasheets, per GPU: FP8 4.5 PFLOPS dense (9 sparse), FP4 9 PFLOPS dense
    # (18 sparse), BF16 2.25 PFLOPS dense (4.5 sparse); HBM3e 180 GB (DGX B200: 1,440 GB / 8; some documents say
    # 192 GB) at 8 TB/s; NVLink 5 1.8 TB/s. Uncertain: capacity (180 vs 192 GB) and the HGX vs GB200 clocks.
    "b200": Hardware("B200 (HGX) 180GB", 2250 * TB, 4500 * TB, 9000 * TB, 8.0 * TB, 180 * GB, 1800 * GB,
                     BLACKWELL_EFF, "NVIDIA DGX B200 / HGX B200 datasheet (per-GPU share); uncertain"),
    # NVIDIA GB300 NVL72 datasheet divided by 72 GPUs: FP4 ~15 PFLOPS dense per Blackwell Ultra GPU (NVIDIA's
    # Blackwell Ultra announcement: 1.5x B200 dense FP4), FP8 ~5 PFLOPS dense (720 PF sparse / 72 / 2), BF16
    # ~2.5 PFLOPS dense (360 PF sparse / 72 / 2); HBM3e 288 GB at 8 TB/s; NVLink 5 1.8 TB/s. Uncertain: NVIDIA
    # quotes rack totals, some with and some without sparsity.
    "gb300": Hardware("GB300 (Blackwell Ultra) 288GB", 2500 * TB, 5000 * TB, 15000 * TB, 8.0 * TB, 288 * GB,
                      1800 * GB, BLACKWELL_EFF, "NVIDIA GB300 NVL72 datasheet (per-GPU share); uncertain"),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 312 TFLOPS dense (624 sparse); no FP8/FP4;
    # HBM2e 80 GB at 2,039 GB/s; NVLink 600 GB/s.
    "a100": Hardware("A100 SXM 80GB", 312 * TB, None, None, 2.039 * TB, 80 * GB, 600 * GB, AMPERE_EFF,
                     "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM)"),
    # NVIDIA H800 Tensor Core GPU datasheet (H800 SXM5): the H100 SXM5's tensor rates (BF16 1,979 TFLOPS sparse =
    # 989.4 dense, FP8 3,958 sparse = 1,979 dense) and HBM3 80 GB at 3.35 TB/s; NVLink 400 GB/s.
    "h800": Hardware("H800 SXM5 80GB", 989.4 * TB, 1979 * TB, None, 3.35 * TB, 80 * GB, 400 * GB, H800_EFF,
                     "NVIDIA H800 Tensor Core GPU datasheet (SXM5)"),
    # NVIDIA HGX H20 product brief: BF16 148 TFLOPS dense, FP8 296 TFLOPS dense, HBM3 96 GB at 4.0 TB/s, NVLink
    # 900 GB/s. Uncertain: NVIDIA publishes the H20 only in partner briefs, not a public datasheet page.
    "h20": Hardware("H20 96GB", 148 * TB, 296 * TB, None, 4.0 * TB, 96 * GB, 900 * GB, HOPPER_EFF,
                    "NVIDIA HGX H20 product brief; uncertain"),
    # NVIDIA L4 Tensor Core GPU datasheet: BF16 242 TFLOPS with sparsity = 121 dense, FP8 485 sparse = 242.5 dense;
    # GDDR6 24 GB at 300 GB/s; no NVLink (PCIe Gen4 x16).
    "l4": Hardware("L4 24GB (PCIe)", 121 * TB, 242.5 * TB, None, 0.3 * TB, 24 * GB, 0.0, PCIE_EFF,
                   "NVIDIA L4 Tensor Core GPU datasheet"),
    # NVIDIA Ampere GA102 GPU architecture whitepaper (GeForce RTX 3090): FP16/BF16 tensor with FP32 accumulate 71
    # TFLOPS dense (142 with sparsity; the GeForce part halves the FP32-accumulate rate); no FP8; GDDR6X 24 GB at
    # 936 GB/s; collectives over PCIe Gen4 (NVLink bridge not assumed).
    "rtx3090": Hardware("GeForce RTX 3090 24GB (PCIe)", 71 * TB, None, None, 0.936 * TB, 24 * GB, 0.0, PCIE_EFF,
                        "NVIDIA Ampere GA102 GPU architecture whitepaper (RTX 3090)"),
}

CPU_PROFILE_PATH = os.path.join(os.path.expanduser("~"), ".cache", "dblock", "cpu_profile.json")


def get(name: str) -> Hardware:
    """A profile by name (h100, h200, b200, gb300, a100, cpu) or a path to a JSON profile written by
    `calibrate_cpu`. The `cpu` profile is read from ~/.cache/dblock/cpu_profile.json (run
    `dblock simulate calibrate --cpu` first)."""
    key = name.lower()
    if key in PROFILES:
        return PROFILES[key]
    if key == "cpu":
        if not os.path.exists(CPU_PROFILE_PATH):
            raise ValueError(f"hardware 'cpu': no calibrated profile at {CPU_PROFILE_PATH} "
                             "(run `dblock simulate calibrate --cpu` first)")
        return load(CPU_PROFILE_PATH)
    if name.endswith(".json") and os.path.exists(name):
        return load(name)
    raise ValueError(f"hardware {name!r}: unknown (allowed: {', '.join(PROFILES)}, cpu, or a profile .json path)")


def load(path: str) -> Hardware:
    """A hardware profile JSON (`simulate calibrate --cpu` writes one), read as untrusted input: the fields of
    `Hardware` and `Efficiency`, rates and capacities finite and > 0 (NVLink >= 0, FP8/FP4 null or > 0)."""
    from dblock.errors import InputFileError
    from dblock.input_files import read_json
    d = read_json(path, "--hardware")
    if not isinstance(d, dict) or not isinstance(d.get("eff"), dict):
        raise InputFileError(f"--hardware {path}: not a hardware profile (a JSON object with 'eff')")
    d = dict(d)
    try:
        eff = Efficiency(**d.pop("eff"))
        hw = Hardware(eff=eff, **d)
    except TypeError as e:
        raise InputFileError(f"--hardware {path}: not a hardware profile ({e})") from None
    checks = [(k, getattr(hw, k), k in ("fp8_flops", "fp4_flops"), k == "nvlink_bw")
              for k in ("bf16_flops", "fp8_flops", "fp4_flops", "hbm_bw", "hbm_bytes", "nvlink_bw")]
    checks += [(f"eff.{k}", getattr(eff, k), False, k not in ("gemm", "stream")) for k in vars(eff)]
    for key, v, nullable, zero_ok in checks:
        if v is None and nullable:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and \
            (v >= 0 if zero_ok else v > 0) and v < 1e30
        if not ok:
            raise InputFileError(f"--hardware {path}: {key} = {str(v)[:40]!r}: expected a finite number "
                                 f"{'>= 0' if zero_ok else '> 0'}")
    if not isinstance(hw.name, str):
        raise InputFileError(f"--hardware {path}: name must be a string")
    return hw


def save(hw: Hardware, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(hw.as_dict(), f, indent=2)


def calibrate_cpu(matmul_n: int = 1024, stream_mb: int = 256, repeats: int = 5, threads: int | None = None,
                  path: str | None = CPU_PROFILE_PATH) -> Hardware:
    """Measure this machine: fp32 matmul FLOP/s (torch if present, else numpy) and a memory stream (copy).

    The measured rates are stored as *achieved* rates (efficiency factors 1.0), so the roofline model predicts
    CPU pass times directly; a calibration from traces can then fit one residual scale (calibrate.py). Medians of
    `repeats` runs. Writes the JSON profile to `path` (None: do not write).
    """
    import numpy as np

    def median_time(fn) -> float:
        fn()  # warm-up
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    try:
        import torch
        if threads:
            torch.set_num_threads(threads)
        a = torch.randn(matmul_n, matmul_n)
        b = torch.randn(matmul_n, matmul_n)
        t_mm = median_time(lambda: a @ b)
        src = torch.empty(stream_mb * 2**20 // 4)
        dst = torch.empty_like(src)
        t_cp = median_time(lambda: dst.copy_(src))
        backend = f"torch {torch.__version__}"
    except ImportError:  # pragma: no cover - torch is a project dependency
        a = np.random.rand(matmul_n, matmul_n).astype(np.float32)
        b = np.random.rand(matmul_n, matmul_n).astype(np.float32)
        t_mm = median_time(lambda: a @ b)
        src = np.empty(stream_mb * 2**20 // 4, np.float32)
        dst = np.empty_like(src)
        t_cp = median_time(lambda: np.copyto(dst, src))
        backend = f"numpy {np.__version__}"
    flops = 2.0 * matmul_n ** 3 / t_mm
    bw = 2.0 * stream_mb * 2**20 / t_cp   # copy reads and writes every byte
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        mem = 0
    import platform
    hw = Hardware(name=f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {backend})",
                  bf16_flops=flops, fp8_flops=None, fp4_flops=None, hbm_bw=bw, hbm_bytes=float(mem), nvlink_bw=0.0,
                  eff=Efficiency(gemm=1.0, stream=1.0, gemm_knee_rows=1, launch_s=5e-6, a2a_latency_s=0.0,
                                 allreduce_latency_s=0.0, a2a_busbw=bw, allreduce_busbw=bw),
                  source=f"measured by dblock.simulator.hardware.calibrate_cpu: {matmul_n}^3 fp32 matmul, "
                         f"{stream_mb} MiB copy, median of {repeats}")
    if path:
        save(hw, path)
    return hw
