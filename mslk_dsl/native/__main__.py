"""``python -m mslk_dsl.native``: build the native launcher for this Python and torch (the child
process that mslk_dsl.native starts; ``mslk-dsl native`` does the same in the foreground)."""
import sys

from mslk_dsl import native

path = native.library_path()
if path is None:
    sys.exit("mslk_dsl.native: tvm_ffi is not installed")
native.build(path)
print(path)
