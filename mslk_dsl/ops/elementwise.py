"""SwiGLU and row-wise FP8 quantization: silu_mul, quantize_fp8_row, dequantize_fp8_row,
silu_mul_quant. MSLK's names, argument order and semantics."""
from __future__ import annotations

import math

import torch

from mslk_dsl.device import target_of
from mslk_dsl.errors import InputError, InputTypeError, UnsupportedDeviceError
from mslk_dsl.ops import random_problems as draw
from mslk_dsl.ops import validate as check
from mslk_dsl.ops.declaration import Launch, OpDecl, declare
from mslk_dsl.ops.dispatch import dtype_name, placeholder
from mslk_dsl.templates import _kernel_limits as limits

_FP8 = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
FP8_AMAX_FLOOR = 1.0 / 512  # MSLK's EPS: a row's absmax is at least this


def fp8_dtype_for(device: torch.device) -> torch.dtype:
    """The FP8 flavour of the device's target (e4m3fnuz on gfx942, e4m3fn elsewhere)."""
    try:
        return _FP8[target_of(device).fp8 or "e4m3fn"]
    except (NotImplementedError, RuntimeError, AssertionError, ValueError):
        # No GPU to ask (tracing with fake/meta tensors on a CPU machine): the OCP flavour.
        return torch.float8_e4m3fn


# -- checks and outputs -----------------------------------------------------------------------------
def _check_pair(op: str, x0, x1) -> None:
    check.tensor(op, "x0", x0, check.FLOAT_DTYPES)
    check.tensor(op, "x1", x1, check.FLOAT_DTYPES)
    check.same_dtype(op, "x1", x1, x0.dtype, "x0")
    check.shape(op, "x1", x1, x0.shape, "x0 and x1 must have the same shape")
    check.same_device(op, "x0", x0, x1=x1)


def _check_scale_ub(op: str, scale_ub, x: torch.Tensor, x_name: str) -> None:
    check.one_element(op, "scale_ub", scale_ub, torch.float32, x, x_name)


# The row count the kernels read without valid_token_count: every row (they take min(M, count)).
ALL_ROWS = 2**31 - 1


def _count_arg(valid_token_count, device) -> torch.Tensor:
    """The kernel's row-count argument: the caller's one element, or a cached ALL_ROWS. The
    kernels always read it (one 4-byte load per CTA), so the op needs no second set of kernels."""
    if valid_token_count is None:
        return placeholder(device, torch.int32, fill=ALL_ROWS)
    return valid_token_count.reshape(1)


# Rows of 8- or 4-byte accesses (a 16-bit row of an even K that is not a multiple of 8), every
# [M, K] tensor 16-byte aligned, K in the op's range: the CuTe kernels run them as one-element rows
# (vec_bytes of one element), whose kernels see the rows congruent and run each row's aligned
# middle in 16-byte vectors and only its edges one element at a time (templates/_cute_rowwise.py,
# "Phased rows"), rather than every vector cut into 8- or 4-byte accesses. Measured on the H200
# (bf16, CUDA-graph replays, one run, 19 shapes: 13 of earlier benchmarks and 6 drawn; time of
# the one-element kernels over the cut ones; docs/benchmarks.md "Rows of 8- or 4-byte accesses as
# phased rows"): quantize_fp8_row 0.62-1.01 from K = 4098 to 38138 (1.11 at 2882);
# silu_mul_quant 0.57-0.97 from 4098 to 19874, 0.92-1.0 at 23980-26382, 1.05-1.21 at
# 27574-38138, 1.31 at 2882; silu_mul 0.68-1.0 from 10054 to 38138, 1.02-1.12 at 2882-7628. Since
# silu_mul's one-element rows of 2049-8192 take its fitted whole-warp tiles, its range starts at
# 2049: 9 rows of 2254-7628 (7 drawn), H200, same method ("Rows of 8- or 4-byte accesses as phased
# rows: silu_mul from 2049"): 0.94-0.98 at the 4-byte rows, 0.996-1.005 at the 8-byte ones. The
# quantizers' rows below 4097 stay cut: at 2398-4066 (6 rows) the one-element rows ran 0.93-1.21
# of their time, slower below ~3400, faster at 3 or 4 rows above it (too few to set a bound by).
# FlyDSL's kernels have no phased rows, so ROCm keeps the cut accesses; fp32 rows were not timed.
# `python tools/bench.py phased_rows` times both ways on given or drawn rows.
PHASED_WORD_ROWS = {"silu_mul": (2049, 40960), "quantize_fp8_row": (4097, 40960), "silu_mul_quant": (4097, 24576)}


def runs_phased(op: str, k: int, elem_bytes: int, width: int) -> bool:
    """Whether a CuTe call of ``op`` on 16-byte aligned rows of ``k`` elements of ``elem_bytes``
    that admit ``width``-byte accesses takes the one-element kernels (PHASED_WORD_ROWS). The
    benchmarks ask it too, to name the configs such a call can take."""
    low, high = PHASED_WORD_ROWS.get(op, (1, 0))
    return width in (4, 8) and elem_bytes == 2 and low <= k <= high


def _access_bytes(op: str, *tensors: torch.Tensor) -> int:
    """The signature's ``vec_bytes`` for a row-wise call of ``op`` on [M, K] ``tensors`` (the first
    an input): ``vector_bytes``, or one element where ``runs_phased``. It reads only shapes, dtypes
    and addresses modulo 16, which key the launch plans, so a plan replays the same choice."""
    width = check.vector_bytes(*tensors)
    first = tensors[0]
    if (runs_phased(op, first.shape[-1], first.element_size(), width)
            and all(t.data_ptr() % limits.VECTOR_BYTES == 0 for t in tensors) and _cute_device(first.device)):
        return first.element_size()
    return width


def _cute_device(device: torch.device) -> bool:
    """Whether ``device``'s kernels are CuTe's; False where it has no GPU target (the kernel choice
    then says so, or a test stands in for it)."""
    try:
        return target_of(device).backend == "cute"
    except UnsupportedDeviceError:
        return False


def _quant_outputs(x: torch.Tensor, *_) -> list:
    """quantize's results: xq of x's shape in the device's FP8 flavour, one fp32 scale per row."""
    return [(tuple(x.shape), fp8_dtype_for(x.device)), (tuple(x.shape[:-1]), torch.float32)]


# The scale_ub of examples whose signature has one: below the amax of most N(0, 1) rows of more
# than ~30 elements, so the cap decides their scales.
EXAMPLE_SCALE_UB = 2.0


def _rows_example(count: int):
    """``count`` N(0, 1) [M, K] inputs of the signature's dtype, then, where the signature has
    ``has_scale_ub``, a scale_ub (EXAMPLE_SCALE_UB)."""
    def example(problem: dict, sig: dict, device) -> tuple:
        dtype = getattr(torch, sig.get("dtype", "bfloat16"))
        rows = tuple(torch.randn(problem["M"], problem["K"], device=device, dtype=dtype) for _ in range(count))
        if sig.get("has_scale_ub"):
            return (*rows, torch.full((1,), EXAMPLE_SCALE_UB, device=device))
        return rows
    return example


# -- references (fp32 math, MSLK's semantics) ---------------------------------------------------------
def _silu_mul_reference(x0, x1, valid_token_count=None):
    """silu(x0) * x1; with ``valid_token_count`` the rows past it are zeros here (the kernels
    leave them as they were)."""
    y = (torch.nn.functional.silu(x0.float()) * x1.float()).to(x0.dtype)
    if valid_token_count is not None:
        y = y.reshape(-1, y.shape[-1])
        y[int(valid_token_count.reshape(())):] = 0
        y = y.reshape(x0.shape)
    return y


def _quantize_reference(x, scale_ub=None, zero_start_index_M=None, use_triton=True, output_device=None,
                        align_rows_to=None):
    """MSLK's Triton quantize_fp8_row in fp32: amax floored at 1/512 and capped by scale_ub,
    scale = amax / fp8_max, xq = fp8(clamp(x / scale)) (tensor / tensor: IEEE division); with
    ``zero_start_index_M``, the rows from it on (of each [N, K] matrix) quantized as zeros; with
    ``align_rows_to``, xq's rows padded with zeros to a multiple of it."""
    fp8 = fp8_dtype_for(x.device)
    xf = x.float()
    if zero_start_index_M is not None:
        xf = xf.masked_fill(_rows_past(x, zero_start_index_M).view(*x.shape[:-1], 1), 0.0)
    amax = torch.clamp(xf.abs().amax(dim=-1), min=FP8_AMAX_FLOOR)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.float().reshape(()))
    scale = amax / torch.full_like(amax, FP8_MAX[fp8])
    xq = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX[fp8], FP8_MAX[fp8]).to(fp8)
    padding = _padded_width(x.shape[-1], align_rows_to) - x.shape[-1]
    if padding:
        xq = torch.nn.functional.pad(xq.view(torch.uint8), (0, padding)).view(fp8)
    return xq, scale


def _padded_width(k: int, align_rows_to) -> int:
    """K rounded up to a multiple of ``align_rows_to`` (K itself without one)."""
    return k if align_rows_to is None else -(-k // align_rows_to) * align_rows_to


def _jagged_shape(x: torch.Tensor) -> tuple[int, int]:
    """(matrices, rows per matrix) of x as MSLK's zero_start_index_M sees it: x's dims but the
    last two are the matrices (one count each), the second-to-last their rows."""
    rows = x.shape[-2] if x.dim() >= 2 else 1
    return math.prod(x.shape[:-2]), rows


def _rows_past(x: torch.Tensor, zero_start_index_M: torch.Tensor) -> torch.Tensor:
    """[matrices, rows] bool: the rows at or past their matrix's zero_start_index_M."""
    matrices, rows = _jagged_shape(x)
    starts = zero_start_index_M.reshape(matrices, 1)
    return torch.arange(rows, device=x.device, dtype=starts.dtype).view(1, rows) >= starts


# -- silu_mul -------------------------------------------------------------------------------------------
def _check_silu_mul(x0, x1, valid_token_count):
    _check_pair("silu_mul", x0, x1)
    check.one_element("silu_mul", "valid_token_count", valid_token_count, torch.int32, x0, "x0")


def _prepare_silu_mul(select, outputs, x0, x1, valid_token_count):
    (y,) = outputs
    if y.numel() == 0:
        return None
    a, b = check.rows(x0), check.rows(x1)
    o = y.view(a.shape)
    kernel, _ = select((_access_bytes("silu_mul", a, b, o), dtype_name(a.dtype)), tuple(a.shape))
    return Launch(kernel, (a, b, o, _count_arg(valid_token_count, a.device)))


silu_mul = declare(OpDecl(
    name="silu_mul", schema="(Tensor x0, Tensor x1, Tensor? valid_token_count=None) -> Tensor",
    doc="""silu(x0) * x1 elementwise (fp32 math, result in the input dtype); any leading dims.
    ``valid_token_count`` (MSLK's): a one-element int32 tensor; rows (of x0 flattened to
    [rows, K]) from that index on are not computed and their outputs are left untouched.
    ``out``: a contiguous tensor of x0's shape and dtype to write into instead of allocating.""",
    check=_check_silu_mul,
    outputs=lambda x0, x1, valid_token_count=None: [(tuple(x0.shape), x0.dtype)],
    prepare=_prepare_silu_mul, signature=("vec_bytes", "dtype"), problem=("M", "K"),
    example=_rows_example(2), reference=_silu_mul_reference, small_problem={"M": 5, "K": 64},
    random_problem=draw.rows))


# -- quantize_fp8_row -------------------------------------------------------------------------------------
def _check_quantize(x, scale_ub, zero_start_index_M=None, use_triton=True, output_device=None, align_rows_to=None):
    op = "quantize_fp8_row"
    check.tensor(op, "x", x, check.FLOAT_DTYPES)
    check.nonempty_rows(op, "x", x)
    _check_scale_ub(op, scale_ub, x, "x")
    if zero_start_index_M is not None:
        check.tensor(op, "zero_start_index_M", zero_start_index_M, (torch.int32, torch.int64), min_ndim=0,
                     unit_last_stride=False)
        check.same_device(op, "x", x, zero_start_index_M=zero_start_index_M)
        matrices, _ = _jagged_shape(x)
        if zero_start_index_M.numel() != matrices:
            raise InputError(f"{op}: zero_start_index_M must hold one row count per [N, K] matrix of x "
                             f"({matrices} for x of shape {tuple(x.shape)}), got shape "
                             f"{tuple(zero_start_index_M.shape)}")
    if not isinstance(use_triton, bool):
        raise InputTypeError(f"{op}: use_triton must be a bool, got {type(use_triton).__name__}")
    if output_device is not None and torch.device(output_device) != x.device:
        raise InputError(f"{op}: output_device {output_device} differs from x's device {x.device}: the "
                         "results are made on x's device (move them with .to())")
    if align_rows_to is not None and (isinstance(align_rows_to, bool) or not isinstance(align_rows_to, int)
                                      or align_rows_to < 1):
        raise InputError(f"{op}: align_rows_to must be a positive int or None, got {align_rows_to!r}")


def _quantize_outputs(x: torch.Tensor, scale_ub=None, zero_start_index_M=None, use_triton=True, output_device=None,
                      align_rows_to=None) -> list:
    """quantize_fp8_row's results: as _quant_outputs, xq's rows padded to ``align_rows_to``."""
    (shape, fp8), scale = _quant_outputs(x)
    return [((*shape[:-1], _padded_width(shape[-1], align_rows_to)), fp8), scale]


def _prepare_quantize(select, outputs, x, scale_ub, zero_start_index_M=None, use_triton=True, output_device=None,
                      align_rows_to=None):
    xq, scale = outputs
    if x.numel() == 0:
        return None
    a = check.rows(x)
    padded = xq.shape[-1] != x.shape[-1]
    # Padded rows: the kernels write compact rows, so into a temporary copied into place after.
    q = torch.empty(a.shape, dtype=xq.dtype, device=a.device) if padded else xq.view(a.shape)
    ub = scale_ub.reshape(1) if scale_ub is not None else placeholder(a.device, torch.float32)
    kernel, _ = select((_access_bytes("quantize_fp8_row", a, q), dtype_name(a.dtype), scale_ub is not None),
                       tuple(a.shape))
    launch = Launch(kernel, (a, ub, q, scale.view(-1)), scratch=(q,) if padded else ())
    if zero_start_index_M is None and not padded:
        return launch

    def finish():
        if padded:
            rows = xq.view(torch.uint8).view(-1, xq.shape[-1])
            rows[:, :x.shape[-1]].copy_(q.view(torch.uint8))
            rows[:, x.shape[-1]:].zero_()
        if zero_start_index_M is not None:
            # The rows past each matrix's count: the kernel quantized them as they are (whatever
            # they hold); they become what a row of zeros gives (xq 0, the floor's scale), on the
            # device, so the call neither syncs nor reads the counts on the host.
            _zero_rows_past(xq, scale, zero_start_index_M, scale_ub)

    return launch._replace(finish=finish, plannable=False)


def _zero_rows_past(xq: torch.Tensor, scale: torch.Tensor, zero_start_index_M: torch.Tensor, scale_ub) -> None:
    past = _rows_past(xq, zero_start_index_M)
    matrices, rows = past.shape
    amax = torch.full((), FP8_AMAX_FLOOR, device=scale.device)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.float().reshape(()))
    zero_row_scale = amax / torch.full_like(amax, FP8_MAX[xq.dtype])   # IEEE division, as the kernels
    # (FP8 tensors have no masked_fill; an FP8 zero is the all-zero byte.)
    xq.view(torch.uint8).view(matrices, rows, -1).masked_fill_(past.unsqueeze(-1), 0)
    # (masked_fill_ with a tensor value reads it on the host: torch.where keeps the call
    # capturable in a CUDA graph.)
    rows_scale = scale.view(matrices, rows)
    rows_scale.copy_(torch.where(past, zero_row_scale, rows_scale))


quantize_fp8_row = declare(OpDecl(
    name="quantize_fp8_row",
    schema="(Tensor x, Tensor? scale_ub=None, Tensor? zero_start_index_M=None, bool use_triton=True, "
           "Device? output_device=None, int? align_rows_to=None) -> (Tensor, Tensor)",
    doc="""Per-row absmax FP8 quantization. Returns (xq [..., K] fp8, scale [...] fp32) where
    ``x ~= xq.float() * scale[..., None]``; rows of zeros give xq = 0 and a finite scale.
    MSLK's arguments: ``scale_ub`` (one fp32 element) caps each row's absmax;
    ``zero_start_index_M`` (int32/int64, one count per [N, K] matrix of x, i.e. x.shape[:-2]
    elements) makes the rows from that count on come out as a row of zeros would (xq 0, the
    smallest scale), whatever they hold; ``use_triton`` (MSLK's choice of its Triton kernel or
    torch) is accepted and has no effect; ``output_device`` must be None or x's device;
    ``align_rows_to`` pads xq's rows with zeros to a multiple of it (xq [..., K rounded up]).
    ``out``: contiguous (xq, scale) tensors to write into instead of allocating.""",
    check=_check_quantize, outputs=_quantize_outputs, prepare=_prepare_quantize,
    plan_when="output_device is None and align_rows_to is None",
    signature=("vec_bytes", "dtype", "has_scale_ub"), problem=("M", "K"),
    example=_rows_example(1), reference=_quantize_reference, small_problem={"M": 5, "K": 64},
    random_problem=draw.rows))


# -- silu_mul_quant -----------------------------------------------------------------------------------------
def _check_silu_mul_quant(x0, x1, scale_ub, valid_token_count):
    op = "silu_mul_quant"
    _check_pair(op, x0, x1)
    check.nonempty_rows(op, "x0", x0)
    _check_scale_ub(op, scale_ub, x0, "x0")
    check.one_element(op, "valid_token_count", valid_token_count, torch.int32, x0, "x0")


def _prepare_silu_mul_quant(select, outputs, x0, x1, scale_ub, valid_token_count):
    xq, scale = outputs
    if x0.numel() == 0:
        return None
    a, b = check.rows(x0), check.rows(x1)
    q = xq.view(a.shape)
    ub = scale_ub.reshape(1) if scale_ub is not None else placeholder(a.device, torch.float32)
    kernel, _ = select((_access_bytes("silu_mul_quant", a, b, q), dtype_name(a.dtype), scale_ub is not None),
                       tuple(a.shape))
    return Launch(kernel, (a, b, ub, q, scale.view(-1), _count_arg(valid_token_count, a.device)))


def _silu_mul_quant_reference(x0, x1, scale_ub=None, valid_token_count=None):
    """The two ops in sequence; rows past ``valid_token_count`` quantize zeros here (the kernels
    leave their xq and scale untouched)."""
    return _quantize_reference(_silu_mul_reference(x0, x1, valid_token_count), scale_ub)


silu_mul_quant = declare(OpDecl(
    name="silu_mul_quant",
    schema="(Tensor x0, Tensor x1, Tensor? scale_ub=None, Tensor? valid_token_count=None) -> (Tensor, Tensor)",
    doc="""quantize_fp8_row(silu_mul(x0, x1), scale_ub), fused: one read of x0/x1, one write of xq.
    ``valid_token_count`` as silu_mul's: xq rows and scales from that row on are left untouched.
    ``out``: contiguous (xq, scale) tensors to write into instead of allocating.""",
    check=_check_silu_mul_quant, outputs=_quant_outputs, prepare=_prepare_silu_mul_quant,
    signature=("vec_bytes", "dtype", "has_scale_ub"), problem=("M", "K"),
    example=_rows_example(2),
    reference=_silu_mul_quant_reference,
    small_problem={"M": 5, "K": 64}, random_problem=draw.rows))


# -- dequantize_fp8_row (plain torch) ---------------------------------------------------------------------------
def dequantize_fp8_row(xq: torch.Tensor, scale: torch.Tensor,
                       out_dtype: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    """Inverse of quantize_fp8_row: xq.float() * scale[..., None], in ``out_dtype``."""
    op = "dequantize_fp8_row"
    check.tensor(op, "xq", xq, check.FP8_DTYPES)
    check.tensor(op, "scale", scale, (torch.float32,), min_ndim=0)
    check.shape(op, "scale", scale, xq.shape[:-1], "one scale per row of xq")
    check.same_device(op, "xq", xq, scale=scale)
    return (xq.float() * scale.unsqueeze(-1)).to(out_dtype or torch.bfloat16)


def _dequantize_example(problem: dict, sig: dict, device) -> tuple:
    x = torch.randn(problem["M"], problem["K"], device=device, dtype=torch.bfloat16)
    return _quantize_reference(x)


declare(OpDecl(
    name="dequantize_fp8_row", schema="(Tensor xq, Tensor scale, ScalarType? out_dtype=None) -> Tensor",
    doc=dequantize_fp8_row.__doc__, composite=dequantize_fp8_row,
    outputs=lambda xq, scale, out_dtype=None: [(tuple(xq.shape), out_dtype or torch.bfloat16)],
    problem=("M", "K"), example=_dequantize_example, reference=dequantize_fp8_row,
    small_problem={"M": 5, "K": 64}, random_problem=draw.rows))
