"""A quick check of the pipeline on a GPU: JIT-compile the framework-test template and silu_mul,
run them, compare with torch. Prints timings. Used when bringing up a new GPU machine."""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("MSLK_DSL_TEMPLATE_PATH", os.path.join(os.path.dirname(__file__), "..", "tests",
                                                             "fixtures", "user_templates"))
from mslk_dsl import device, jit, registry  # noqa: E402

print("target", device.current_target(), torch.cuda.get_device_name())
t0 = time.perf_counter()
k = jit.get_kernel(registry.get_template("scale_copy_cute"), {"threads": 256}, "sm90a", {"factor": 3})
print(f"scale_copy JIT {time.perf_counter() - t0:.2f}s", dict(jit.stats))
x = torch.randn(100003, device="cuda")
y = torch.empty_like(x)
k(x, y)
torch.cuda.synchronize()
print("scale_copy ok:", torch.equal(y, x * 3))
import mslk_dsl.ops as ops  # noqa: E402

for shape in [(1, 1), (3, 5000), (4096, 4096)]:
    a = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    t0 = time.perf_counter()
    out = ops.silu_mul(a, b)
    torch.cuda.synchronize()
    ref = (torch.nn.functional.silu(a.float()) * b.float()).to(a.dtype)
    print(shape, f"{time.perf_counter() - t0:.2f}s", "max err", (out.float() - ref.float()).abs().max().item())
