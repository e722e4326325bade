"""The torch references both backends' norm tests compare against (fp32 math, dtype output)."""
import torch


def ref_rmsnorm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def ref_rmsnorm_add(x, residual, weight, eps):
    """(rmsnorm(h), h) with h = x + residual rounded to the dtype, as the fused op returns."""
    h = (x.float() + residual.float()).to(x.dtype)
    return ref_rmsnorm(h, weight, eps), h
