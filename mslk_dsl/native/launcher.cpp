// The native launch path of the op layer (see mslk_dsl/native/__init__.py for how it is built
// and used). One FastOp per op holds launch plans keyed by the exact layout of the call's inputs
// (dtype, device, shape, strides, start address modulo 16 of each tensor; the type of each scalar, and
// the value of the scalars the op keys its plans by: its plan_values).
// A call whose layout has a plan allocates the plan's outputs, launches the kernel through the
// TVM-FFI C ABI on the caller's current stream, and returns the outputs; any other call returns
// the MISS sentinel and the Python op takes its full path (validation, kernel choice), which then
// adds a plan. Inputs are read through the DLPack exchange API that torch publishes
// (torch.Tensor.__dlpack_c_exchange_api__, which also gives the current stream); outputs are
// allocated by torch's allocator for their device without the dispatcher (NewOutput) and wrapped
// as Python tensors directly (the exchange API's allocator round-trips through DLPack and costs
// ~3 us per output on the H200 host).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <ATen/core/Tensor.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#ifdef MSLK_WITH_CUDA  // a CUDA build of torch: link libtorch_cuda for its allocation path
#include <ATen/cuda/EmptyTensor.h>
#endif
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int kMaxInputs = 16;   // the op's arguments (plus its out= tensors)
constexpr int kMaxOutputs = 8;   // results and per-call scratch
constexpr int kMaxArgs = 24;
constexpr int kMaxDims = 6;
constexpr int kTableSize = 1024;  // plans per op; the table is cleared when it fills up

// Where a kernel argument comes from: an input, an output, a tensor the plan holds, or a scalar
// the plan holds (a value derived from the layout and the plan's keyed values).
enum Source : int8_t { kInput = 0, kOutput = 1, kExtra = 2, kConstant = 3 };

struct TensorShape {
  int32_t ndim;
  int64_t shape[kMaxDims];
  int64_t strides[kMaxDims];
};

struct InputLayout {
  bool is_tensor;
  int32_t scalar_kind;  // kTVMFFIInt / kTVMFFIFloat / kTVMFFIBool when !is_tensor
  int64_t value_bits;   // a keyed scalar's value (a float's bits), else 0
  DLDataType dtype;
  DLDevice device;
  TensorShape view;
  uint8_t addr_mod16;  // the data pointer modulo 16: what widths of access its rows admit
};

struct KernelArg {
  Source source;
  int8_t index;
  TensorShape view;  // the shape and strides the kernel sees (a view of the source's memory)
};

struct Plan {
  bool used;
  uint64_t hash;
  int n_inputs;
  InputLayout inputs[kMaxInputs];
  int n_outputs;
  int8_t out_dtype[kMaxOutputs];   // c10::ScalarType
  int8_t out_device_type[kMaxOutputs];  // c10::DeviceType
  int8_t out_device_index[kMaxOutputs];
  DLDataType out_dl_dtype[kMaxOutputs];  // the same, as DLPack says them to the kernel
  DLDevice out_dl_device[kMaxOutputs];
  TensorShape out_shape[kMaxOutputs];
  int n_args;
  KernelArg args[kMaxArgs];
  int n_returns;
  int8_t returns[kMaxOutputs];
  uint32_t returned;  // bit k: output k is returned (the others are scratch: never a Python object)
  uint32_t written;  // bit i: the kernel writes input i (a caller's out= tensor, an in-place input)
  bool stream_bound;  // the plan holds a buffer of one stream (split-K counters): it serves only
  void* stream;       // that stream (null: the default stream)
  PyObject* extras;  // tuple of the extra tensor arguments (e.g. placeholders), owned
  PyObject* func;    // the tvm_ffi.Function, owned
  TVMFFIObjectHandle func_handle;
  DLTensor extra_dl[kMaxArgs];  // DLTensor of each tensor extra (valid while `extras` lives)
  TVMFFIAny constant[kMaxArgs];  // each kConstant argument
};

PyObject* g_miss = nullptr;  // the MISS sentinel
// What a failed kernel call raises: mslk_dsl.errors.KernelLaunchError (RuntimeError if that
// cannot be imported), as the Python path does.
PyObject* g_launch_error = nullptr;

struct FastOp {
  PyObject_HEAD
  const DLPackExchangeAPI* api;
  PyObject* tensor_types;  // tuple of the exact types taken as tensors (torch.Tensor, Parameter)
  Plan* table;
  int count;
  uint32_t value_mask;  // bit i: argument i is keyed by value (a plan_value), not only by type
  PyObject* name;       // the op's name (str), for the errors a kernel call raises
};

bool IsTensor(FastOp* self, PyObject* obj) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(obj));
  Py_ssize_t n = PyTuple_GET_SIZE(self->tensor_types);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyTuple_GET_ITEM(self->tensor_types, i) == type) return true;
  }
  return false;
}

// The kind of a non-tensor argument, part of the layout key; None (an optional input left out)
// is a kind of its own, so a call with and one without that input never share a plan.
int ScalarKind(PyObject* obj) {
  if (obj == Py_None) return kTVMFFINone;
  if (PyBool_Check(obj)) return kTVMFFIBool;
  if (PyLong_CheckExact(obj)) return kTVMFFIInt;
  if (PyFloat_CheckExact(obj)) return kTVMFFIFloat;
  return -1;
}

void CopyShape(const DLTensor& t, TensorShape* out) {
  out->ndim = t.ndim;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    out->shape[d] = t.shape[d];
    out->strides[d] = t.strides != nullptr ? t.strides[d] : stride;
    stride *= t.shape[d];
  }
}

bool SameShape(const TensorShape& a, const DLTensor& t) {
  if (a.ndim != t.ndim) return false;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (a.shape[d] != t.shape[d]) return false;
    if (a.strides[d] != (t.strides != nullptr ? t.strides[d] : stride)) return false;
    stride *= t.shape[d];
  }
  return true;
}

inline uint64_t Mix(uint64_t h, uint64_t v) { return (h ^ v) * 1099511628211ull; }

// A scalar as TVM-FFI passes it: the kind Python's tvm_ffi would give it (bool, int, float).
// False for anything else and for an int beyond 64 bits (such a call takes the Python path).
bool ScalarAny(PyObject* obj, TVMFFIAny* any) {
  std::memset(any, 0, sizeof(*any));
  int kind = ScalarKind(obj);
  if (kind != kTVMFFIInt && kind != kTVMFFIFloat && kind != kTVMFFIBool) return false;
  any->type_index = kind;
  if (kind == kTVMFFIFloat) {
    any->v_float64 = PyFloat_AS_DOUBLE(obj);
    return true;
  }
  int overflow = 0;
  any->v_int64 = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (overflow != 0 || (any->v_int64 == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// What a keyed scalar contributes to the layout: its value's 64 bits (an int, a bool, a float's
// bits: v_int64 and v_float64 share TVMFFIAny's union); None has none.
bool ScalarBits(PyObject* obj, int kind, int64_t* bits) {
  *bits = 0;
  if (kind == kTVMFFINone) return true;
  TVMFFIAny any;
  if (!ScalarAny(obj, &any)) return false;
  *bits = any.v_int64;
  return true;
}

// The caller's current stream on `device` (null on the CPU or where torch gives none).
bool CurrentStream(const DLPackExchangeAPI* api, DLDevice device, void** stream) {
  *stream = nullptr;
  if (device.device_type == kDLCPU || api->current_work_stream == nullptr) return true;
  return api->current_work_stream(device.device_type, device.device_id, stream) == 0;
}

uint64_t HashTensor(uint64_t h, const DLTensor& t, uint8_t addr_mod16) {
  h = Mix(h, (uint64_t(t.dtype.code) << 24) | (uint64_t(t.dtype.bits) << 8) | t.dtype.lanes);
  h = Mix(h, (uint64_t(t.device.device_type) << 32) | uint32_t(t.device.device_id));
  h = Mix(h, uint64_t(t.ndim) * 16 + addr_mod16);
  for (int d = 0; d < t.ndim; ++d) {
    h = Mix(h, uint64_t(t.shape[d]));
    h = Mix(h, t.strides != nullptr ? uint64_t(t.strides[d]) : ~0ull);
  }
  return h;
}

uint8_t AddressMod16(const DLTensor& t) {
  return uint8_t((reinterpret_cast<uintptr_t>(t.data) + t.byte_offset) & 15);
}

bool SameDType(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

// An output of the plan: compact, uninitialized. at::detail::empty_{cpu,cuda} is where at::empty
// ends up after the dispatcher (device guard, the device's caching allocator, the tensor); calling
// it directly saves the dispatch, a few hundred ns per output.
at::Tensor NewOutput(const Plan& plan, int k) {
  const TensorShape& shape = plan.out_shape[k];
  c10::IntArrayRef size(shape.shape, shape.ndim);
  auto dtype = static_cast<c10::ScalarType>(plan.out_dtype[k]);
  c10::Device device(static_cast<c10::DeviceType>(plan.out_device_type[k]), plan.out_device_index[k]);
  switch (device.type()) {
    case c10::DeviceType::CPU:
      return at::Tensor(at::detail::empty_cpu(size, dtype));
#ifdef MSLK_WITH_CUDA
    case c10::DeviceType::CUDA:
      return at::Tensor(at::detail::empty_cuda(size, dtype, device, std::nullopt));
#endif
    default:
      return at::empty(size, at::TensorOptions().dtype(dtype).device(device));
  }
}

// The bytes [begin, end) a tensor's elements span (empty when it has no elements).
void ByteRange(const DLTensor& t, uintptr_t* begin, uintptr_t* end) {
  *begin = reinterpret_cast<uintptr_t>(t.data) + t.byte_offset;
  int64_t last = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 0) {
      *end = *begin;
      return;
    }
    last += (t.shape[d] - 1) * (t.strides != nullptr ? t.strides[d] : 0);
  }
  if (t.strides == nullptr) {  // compact: the last element is numel - 1
    last = 1;
    for (int d = 0; d < t.ndim; ++d) last *= t.shape[d];
    last -= 1;
  }
  *end = *begin + uintptr_t((last + 1) * ((t.dtype.bits * t.dtype.lanes + 7) / 8));
}

// A tensor the kernel writes (an out= argument) must not share memory with any other tensor
// argument of the call: the kernel would read what it already overwrote. Such a call takes the
// Python path, which raises.
bool WrittenOverlaps(const Plan& plan, const DLTensor* dl, int n) {
  for (int i = 0; i < n; ++i) {
    if (!(plan.written >> i & 1u)) continue;
    uintptr_t b0, e0;
    ByteRange(dl[i], &b0, &e0);
    for (int j = 0; j < n; ++j) {
      if (j == i || !plan.inputs[j].is_tensor) continue;
      uintptr_t b1, e1;
      ByteRange(dl[j], &b1, &e1);
      if (b0 < e1 && b1 < e0) return true;
    }
  }
  return false;
}

void RaiseFFIError(PyObject* op) {
  TVMFFIObjectHandle err = nullptr;
  TVMFFIErrorMoveFromRaised(&err);
  if (err == nullptr) {
    PyErr_Format(g_launch_error, "%U: the kernel call failed", op);
    return;
  }
  const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(err);
  // (PyErr_Format has no %.*s: build the strings first.)
  PyObject* kind = PyUnicode_DecodeUTF8(cell->kind.data, Py_ssize_t(cell->kind.size), "replace");
  PyObject* message = PyUnicode_DecodeUTF8(cell->message.data, Py_ssize_t(cell->message.size), "replace");
  if (kind != nullptr && message != nullptr) {
    PyErr_Format(g_launch_error, "%U: the kernel call failed: %U: %U", op, kind, message);
  }
  Py_XDECREF(kind);
  Py_XDECREF(message);
  TVMFFIObjectDecRef(err);
}

void ReleasePlan(Plan* plan) {
  if (!plan->used) return;
  Py_CLEAR(plan->extras);
  Py_CLEAR(plan->func);
  plan->used = false;
}

// ------------------------------------------------------------------------------------- the call
PyObject* FastOpCall(PyObject* py_self, PyObject* const* argv, size_t nargsf, PyObject* kwnames) {
  FastOp* self = reinterpret_cast<FastOp*>(py_self);
  Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if (kwnames != nullptr || n > kMaxInputs) return Py_NewRef(g_miss);
  DLTensor dl[kMaxInputs];
  uint8_t addr_mod16[kMaxInputs];
  int64_t bits[kMaxInputs];
  uint64_t h = 1469598103934665603ull ^ uint64_t(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = argv[i];
    if (IsTensor(self, obj)) {
      if (self->api->dltensor_from_py_object_no_sync(obj, &dl[i]) != 0) {
        PyErr_Clear();  // e.g. a tensor DLPack cannot express: the Python path decides
        return Py_NewRef(g_miss);
      }
      if (dl[i].ndim > kMaxDims) return Py_NewRef(g_miss);
      addr_mod16[i] = AddressMod16(dl[i]);
      h = HashTensor(h, dl[i], addr_mod16[i]);
    } else {
      int kind = ScalarKind(obj);
      if (kind < 0) return Py_NewRef(g_miss);
      h = Mix(h, 0x5ca1a7 + uint64_t(kind));
      bits[i] = 0;
      if (self->value_mask >> i & 1u) {
        if (!ScalarBits(obj, kind, &bits[i])) return Py_NewRef(g_miss);
        h = Mix(h, uint64_t(bits[i]));
      }
    }
  }
  // Open addressing, linear probing; a slot holds the plan of one exact layout.
  Plan* plan = nullptr;
  for (int probe = 0; probe < kTableSize; ++probe) {
    Plan* p = &self->table[(h + probe) % kTableSize];
    if (!p->used) break;
    if (p->hash != h || p->n_inputs != n) continue;
    bool same = true;
    for (Py_ssize_t i = 0; i < n && same; ++i) {
      const InputLayout& in = p->inputs[i];
      if (in.is_tensor) {
        same = IsTensor(self, argv[i]) && SameDType(in.dtype, dl[i].dtype) &&
               in.device.device_type == dl[i].device.device_type &&
               in.device.device_id == dl[i].device.device_id && in.addr_mod16 == addr_mod16[i] &&
               SameShape(in.view, dl[i]);
      } else {
        same = !IsTensor(self, argv[i]) && ScalarKind(argv[i]) == in.scalar_kind && bits[i] == in.value_bits;
      }
    }
    if (same) {
      plan = p;
      break;
    }
  }
  if (plan == nullptr || (plan->written != 0 && WrittenOverlaps(*plan, dl, int(n)))) return Py_NewRef(g_miss);
  DLDevice device = plan->inputs[0].device;
  for (int i = 0; i < n; ++i) {
    if (plan->inputs[i].is_tensor) {
      device = plan->inputs[i].device;
      break;
    }
  }
  // The caller's current stream: the kernel runs on it, and a stream-bound plan serves only it.
  void* stream = nullptr;
  if (!CurrentStream(self->api, device, &stream)) {
    PyErr_Clear();
    return Py_NewRef(g_miss);
  }
  if (plan->stream_bound && plan->stream != stream) return Py_NewRef(g_miss);

  // Outputs: allocated by torch's caching allocator, compact, on the plan's device. Returned ones
  // become Python tensors; scratch stays a C++ tensor, freed when the call returns (after the
  // launch, on the stream the kernel runs on: the caching allocator hands its memory only to
  // work queued after the kernel), which saves a Python object's making and freeing per tensor.
  PyObject* outputs[kMaxOutputs] = {nullptr};
  at::Tensor scratch[kMaxOutputs];
  DLTensor out_dl[kMaxOutputs];
  PyObject* result = nullptr;
  try {
    for (int k = 0; k < plan->n_outputs; ++k) {
      at::Tensor t = NewOutput(*plan, k);
      // The kernel sees the output as the plan recorded it (compact; shape and strides are
      // read from the plan, not from the tensor).
      DLTensor& o = out_dl[k];
      o.data = t.data_ptr();
      o.device = plan->out_dl_device[k];
      o.ndim = plan->out_shape[k].ndim;
      o.dtype = plan->out_dl_dtype[k];
      o.shape = const_cast<int64_t*>(plan->out_shape[k].shape);
      o.strides = const_cast<int64_t*>(plan->out_shape[k].strides);
      o.byte_offset = 0;
      if (!(plan->returned >> k & 1u)) {
        scratch[k] = std::move(t);
        continue;
      }
      outputs[k] = THPVariable_Wrap(std::move(t));
      if (outputs[k] == nullptr) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_MemoryError, "mslk_dsl: output allocation failed");
        goto done;
      }
    }
  } catch (...) {  // e.g. out of memory: the Python error torch itself raises (torch.OutOfMemoryError)
    torch::translate_exception_to_python(std::current_exception());
    goto done;
  }
  {
    // Kernel arguments: views of the inputs and outputs, and the plan's extras.
    DLTensor views[kMaxArgs];
    TVMFFIAny args[kMaxArgs];
    for (int a = 0; a < plan->n_args; ++a) {
      const KernelArg& arg = plan->args[a];
      TVMFFIAny* any = &args[a];
      std::memset(any, 0, sizeof(*any));
      if (arg.source == kExtra) {  // a tensor the plan holds (placeholder, weight-like)
        any->type_index = kTVMFFIDLTensorPtr;
        any->v_ptr = &plan->extra_dl[a];
        continue;
      }
      if (arg.source == kConstant) {  // a scalar the plan holds
        *any = plan->constant[a];
        continue;
      }
      if (arg.source == kInput && !plan->inputs[arg.index].is_tensor) {
        if (!ScalarAny(argv[arg.index], any)) {  // an int beyond 64 bits: the Python path says so
          result = Py_NewRef(g_miss);
          goto done;
        }
        continue;
      }
      views[a] = arg.source == kInput ? dl[arg.index] : out_dl[arg.index];
      views[a].ndim = arg.view.ndim;
      views[a].shape = const_cast<int64_t*>(arg.view.shape);
      views[a].strides = const_cast<int64_t*>(arg.view.strides);
      any->type_index = kTVMFFIDLTensorPtr;
      any->v_ptr = &views[a];
    }
    // The caller's current stream, as TVM-FFI hands it to the kernel (restored afterwards).
    TVMFFIStreamHandle previous = nullptr;
    bool on_device = device.device_type != kDLCPU && self->api->current_work_stream != nullptr;
    if (on_device && TVMFFIEnvSetStream(device.device_type, device.device_id, stream, &previous) != 0) {
      if (!PyErr_Occurred()) RaiseFFIError(self->name);
      goto done;
    }
    TVMFFIAny ret;
    std::memset(&ret, 0, sizeof(ret));
    ret.type_index = kTVMFFINone;
    int rc = TVMFFIFunctionCall(plan->func_handle, args, plan->n_args, &ret);
    if (on_device && previous != stream) TVMFFIEnvSetStream(device.device_type, device.device_id, previous, nullptr);
    if (rc != 0) {
      RaiseFFIError(self->name);
      goto done;
    }
    if (ret.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(ret.v_obj);
  }
  if (plan->n_returns == 0) {
    result = Py_NewRef(Py_None);
  } else if (plan->n_returns == 1) {
    result = Py_NewRef(outputs[plan->returns[0]]);
  } else {
    result = PyTuple_New(plan->n_returns);
    if (result != nullptr) {
      for (int r = 0; r < plan->n_returns; ++r) {
        PyTuple_SET_ITEM(result, r, Py_NewRef(outputs[plan->returns[r]]));
      }
    }
  }
done:
  for (int k = 0; k < plan->n_outputs; ++k) Py_XDECREF(outputs[k]);
  return result;
}

// --------------------------------------------------------------------------- adding a plan
// add(inputs, outputs, args, returns, func, written=(), constants=(), stream_bound=False):
// `inputs` as the call passed them (tensors and scalars); `outputs` the tensors the op allocated;
// `args` the kernel's arguments, each an input, an output, a view of one (same data pointer), or
// anything else (an extra: kept and passed as it is); `returns` the indices of the outputs the op
// returns; `written` the indices of inputs the kernel writes (out= tensors, in-place inputs: a
// later call where one overlaps another input misses); `constants` the indices of the scalar
// arguments the plan holds (derived from the layout and the keyed values: the same for every
// call the plan serves); `stream_bound`: the plan holds a buffer of the current stream, so it
// serves calls on that stream only.
PyObject* FastOpAdd(PyObject* py_self, PyObject* argv) {
  FastOp* self = reinterpret_cast<FastOp*>(py_self);
  PyObject *inputs, *outputs, *args, *returns, *func, *written = nullptr, *constants = nullptr;
  int stream_bound = 0;
  if (!PyArg_ParseTuple(argv, "O!O!O!O!O|O!O!p", &PyTuple_Type, &inputs, &PyTuple_Type, &outputs, &PyTuple_Type,
                        &args, &PyTuple_Type, &returns, &func, &PyTuple_Type, &written, &PyTuple_Type, &constants,
                        &stream_bound)) {
    return nullptr;
  }
  uint32_t constant_mask = 0;
  for (Py_ssize_t c = 0; constants != nullptr && c < PyTuple_GET_SIZE(constants); ++c) {
    long index = PyLong_AsLong(PyTuple_GET_ITEM(constants, c));
    if (index < 0 || index >= PyTuple_GET_SIZE(args) || index >= kMaxArgs) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "FastOp.add: constant index out of range");
      return nullptr;
    }
    constant_mask |= 1u << index;
  }
  Py_ssize_t n_in = PyTuple_GET_SIZE(inputs), n_out = PyTuple_GET_SIZE(outputs);
  Py_ssize_t n_args = PyTuple_GET_SIZE(args), n_ret = PyTuple_GET_SIZE(returns);
  if (n_in > kMaxInputs || n_out > kMaxOutputs || n_args > kMaxArgs || n_ret > kMaxOutputs) {
    PyErr_SetString(PyExc_ValueError, "FastOp.add: too many inputs, outputs or arguments");
    return nullptr;
  }
  PyObject* chandle = PyObject_CallMethod(func, "__chandle__", nullptr);
  if (chandle == nullptr) return nullptr;
  void* func_handle = PyLong_AsVoidPtr(chandle);
  Py_DECREF(chandle);
  if (PyErr_Occurred()) return nullptr;

  Plan plan;
  std::memset(&plan, 0, sizeof(plan));
  plan.n_inputs = int(n_in);
  DLTensor in_dl[kMaxInputs], out_dl[kMaxOutputs];
  uint64_t h = 1469598103934665603ull ^ uint64_t(n_in);
  for (Py_ssize_t i = 0; i < n_in; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(inputs, i);
    InputLayout& in = plan.inputs[i];
    in.is_tensor = IsTensor(self, obj);
    if (in.is_tensor) {
      if (self->api->dltensor_from_py_object_no_sync(obj, &in_dl[i]) != 0) return nullptr;
      if (in_dl[i].ndim > kMaxDims) Py_RETURN_FALSE;
      in.dtype = in_dl[i].dtype;
      in.device = in_dl[i].device;
      in.addr_mod16 = AddressMod16(in_dl[i]);
      CopyShape(in_dl[i], &in.view);
      h = HashTensor(h, in_dl[i], in.addr_mod16);
    } else {
      in.scalar_kind = ScalarKind(obj);
      if (in.scalar_kind < 0) Py_RETURN_FALSE;
      h = Mix(h, 0x5ca1a7 + uint64_t(in.scalar_kind));
      if (self->value_mask >> i & 1u) {
        if (!ScalarBits(obj, in.scalar_kind, &in.value_bits)) Py_RETURN_FALSE;
        h = Mix(h, uint64_t(in.value_bits));
      }
    }
  }
  plan.n_outputs = int(n_out);
  for (Py_ssize_t k = 0; k < n_out; ++k) {
    PyObject* obj = PyTuple_GET_ITEM(outputs, k);
    if (!IsTensor(self, obj) || self->api->dltensor_from_py_object_no_sync(obj, &out_dl[k]) != 0 ||
        out_dl[k].ndim > kMaxDims) {
      PyErr_Clear();
      Py_RETURN_FALSE;
    }
    const at::Tensor& out = THPVariable_Unpack(obj);
    plan.out_dtype[k] = static_cast<int8_t>(out.scalar_type());
    plan.out_device_type[k] = static_cast<int8_t>(out.device().type());
    plan.out_device_index[k] = out.device().index();
    plan.out_dl_dtype[k] = out_dl[k].dtype;
    plan.out_dl_device[k] = out_dl[k].device;
    CopyShape(out_dl[k], &plan.out_shape[k]);
    // Outputs are allocated compact: a plan whose outputs were not is not taken.
    TensorShape compact = plan.out_shape[k];
    int64_t stride = 1;
    for (int d = compact.ndim - 1; d >= 0; --d) {
      if (compact.shape[d] != 1 && compact.strides[d] != stride) Py_RETURN_FALSE;
      stride *= compact.shape[d];
    }
  }
  PyObject* extras = PyTuple_New(n_args);
  if (extras == nullptr) return nullptr;
  int n_extras = 0;
  plan.n_args = int(n_args);
  for (Py_ssize_t a = 0; a < n_args; ++a) {
    PyObject* obj = PyTuple_GET_ITEM(args, a);
    KernelArg& arg = plan.args[a];
    if (constant_mask >> a & 1u) {  // held as it is, even where an input has the same object
      arg.source = kConstant;
      if (!ScalarAny(obj, &plan.constant[a])) {
        Py_DECREF(extras);
        Py_RETURN_FALSE;
      }
      continue;
    }
    arg.source = kExtra;
    for (Py_ssize_t i = 0; i < n_in && arg.source == kExtra; ++i) {
      if (PyTuple_GET_ITEM(inputs, i) == obj && !plan.inputs[i].is_tensor &&
          plan.inputs[i].scalar_kind != kTVMFFINone) {
        arg.source = kInput;
        arg.index = int8_t(i);
      }
    }
    if (arg.source == kExtra && IsTensor(self, obj)) {
      DLTensor t;
      if (self->api->dltensor_from_py_object_no_sync(obj, &t) != 0 || t.ndim > kMaxDims) {
        PyErr_Clear();
        Py_DECREF(extras);
        Py_RETURN_FALSE;
      }
      char* data = static_cast<char*>(t.data) + t.byte_offset;
      for (Py_ssize_t i = 0; i < n_in && arg.source == kExtra; ++i) {
        if (plan.inputs[i].is_tensor && data == static_cast<char*>(in_dl[i].data) + in_dl[i].byte_offset &&
            SameDType(t.dtype, in_dl[i].dtype)) {
          arg.source = kInput;
          arg.index = int8_t(i);
        }
      }
      for (Py_ssize_t k = 0; k < n_out && arg.source == kExtra; ++k) {
        if (data == static_cast<char*>(out_dl[k].data) + out_dl[k].byte_offset && SameDType(t.dtype, out_dl[k].dtype)) {
          arg.source = kOutput;
          arg.index = int8_t(k);
        }
      }
      if (arg.source != kExtra) {
        CopyShape(t, &arg.view);
      } else {
        plan.extra_dl[a] = t;  // a tensor kept alive by `extras`
      }
    }
    if (arg.source == kExtra) {
      arg.index = int8_t(n_extras);
      if (!IsTensor(self, obj)) {
        // A scalar that is not one of the inputs would be baked into the plan while the
        // layout key ignores scalar values: such calls keep the Python path.
        Py_DECREF(extras);
        Py_RETURN_FALSE;
      }
      PyTuple_SET_ITEM(extras, n_extras++, Py_NewRef(obj));
    }
  }
  if (_PyTuple_Resize(&extras, n_extras) != 0) return nullptr;
  plan.n_returns = int(n_ret);
  for (Py_ssize_t r = 0; r < n_ret; ++r) {
    long index = PyLong_AsLong(PyTuple_GET_ITEM(returns, r));
    if (index < 0 || index >= n_out) {
      Py_DECREF(extras);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "FastOp.add: return index out of range");
      return nullptr;
    }
    plan.returns[r] = int8_t(index);
    plan.returned |= 1u << index;
  }
  for (Py_ssize_t w = 0; written != nullptr && w < PyTuple_GET_SIZE(written); ++w) {
    long index = PyLong_AsLong(PyTuple_GET_ITEM(written, w));
    if (index < 0 || index >= n_in || !plan.inputs[index].is_tensor) {
      Py_DECREF(extras);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "FastOp.add: written index is not a tensor input");
      return nullptr;
    }
    plan.written |= 1u << index;
  }
  plan.stream_bound = stream_bound != 0;
  if (stream_bound) {
    DLDevice device{kDLCPU, 0};
    for (Py_ssize_t i = 0; i < n_in; ++i) {
      if (plan.inputs[i].is_tensor) {
        device = plan.inputs[i].device;
        break;
      }
    }
    if (!CurrentStream(self->api, device, &plan.stream)) {
      Py_DECREF(extras);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "FastOp.add: no current stream");
      return nullptr;
    }
  }
  plan.used = true;
  plan.hash = h;
  plan.extras = extras;
  plan.func = Py_NewRef(func);
  plan.func_handle = func_handle;

  if (self->count >= kTableSize * 3 / 4) {  // keep probes short: start over
    for (int s = 0; s < kTableSize; ++s) ReleasePlan(&self->table[s]);
    self->count = 0;
  }
  for (int probe = 0; probe < kTableSize; ++probe) {
    Plan* slot = &self->table[(h + probe) % kTableSize];
    bool replace = slot->used && slot->hash == h && slot->n_inputs == plan.n_inputs &&
                   std::memcmp(slot->inputs, plan.inputs, sizeof(plan.inputs)) == 0;
    if (!slot->used || replace) {
      if (replace) {
        ReleasePlan(slot);
      } else {
        ++self->count;
      }
      *slot = plan;
      Py_RETURN_TRUE;
    }
  }
  Py_RETURN_FALSE;
}

PyObject* FastOpClear(PyObject* py_self, PyObject*) {
  FastOp* self = reinterpret_cast<FastOp*>(py_self);
  for (int s = 0; s < kTableSize; ++s) ReleasePlan(&self->table[s]);
  self->count = 0;
  Py_RETURN_NONE;
}

PyObject* FastOpLen(PyObject* py_self, PyObject*) {
  return PyLong_FromLong(reinterpret_cast<FastOp*>(py_self)->count);
}

// FastOp(exchange_api_capsule, tensor_types, value_positions=()): value_positions are the
// arguments whose values (not only types) key the plans.
PyObject* FastOpNew(PyTypeObject* type, PyObject* argv, PyObject* kwargs) {
  PyObject *capsule, *types, *positions = nullptr, *name = nullptr;
  if (!PyArg_ParseTuple(argv, "OO!|O!U", &capsule, &PyTuple_Type, &types, &PyTuple_Type, &positions, &name)) {
    return nullptr;
  }
  uint32_t value_mask = 0;
  for (Py_ssize_t p = 0; positions != nullptr && p < PyTuple_GET_SIZE(positions); ++p) {
    long index = PyLong_AsLong(PyTuple_GET_ITEM(positions, p));
    if (index < 0 || index >= kMaxInputs) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "FastOp: value position out of range");
      return nullptr;
    }
    value_mask |= 1u << index;
  }
  auto* api = static_cast<const DLPackExchangeAPI*>(PyCapsule_GetPointer(capsule, "dlpack_exchange_api"));
  if (api == nullptr) return nullptr;
  if (api->dltensor_from_py_object_no_sync == nullptr || api->managed_tensor_allocator == nullptr ||
      api->managed_tensor_to_py_object_no_sync == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "the DLPack exchange API lacks a function the launcher needs");
    return nullptr;
  }
  FastOp* self = reinterpret_cast<FastOp*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->api = api;
  self->tensor_types = Py_NewRef(types);
  self->name = name != nullptr ? Py_NewRef(name) : PyUnicode_FromString("mslk_dsl op");
  if (self->name == nullptr) {
    Py_DECREF(self);
    return nullptr;
  }
  self->table = static_cast<Plan*>(PyMem_Calloc(kTableSize, sizeof(Plan)));
  self->count = 0;
  self->value_mask = value_mask;
  if (self->table == nullptr) {
    Py_DECREF(self);
    return PyErr_NoMemory();
  }
  return reinterpret_cast<PyObject*>(self);
}

void FastOpDealloc(PyObject* py_self) {
  FastOp* self = reinterpret_cast<FastOp*>(py_self);
  if (self->table != nullptr) {
    for (int s = 0; s < kTableSize; ++s) ReleasePlan(&self->table[s]);
    PyMem_Free(self->table);
  }
  Py_XDECREF(self->tensor_types);
  Py_XDECREF(self->name);
  Py_TYPE(py_self)->tp_free(py_self);
}

PyObject* FastOpVectorcallEntry(PyObject* callable, PyObject* const* argv, size_t nargsf, PyObject* kwnames) {
  return FastOpCall(callable, argv, nargsf, kwnames);
}

// ------------------------------------------------------------------ a FastOp with its fallback
// What an eager op function calls: FastOp.with_fallback(fn) serves a call from a plan, or else
// calls fn with the same arguments (the op's Python path), so a call that a plan serves costs the
// eager function one C call and no sentinel test in Python.
struct FastCall {
  PyObject_HEAD
  vectorcallfunc vectorcall;
  PyObject* op;        // the FastOp
  PyObject* fallback;  // called on a miss
};

PyObject* FastCallVectorcall(PyObject* py_self, PyObject* const* argv, size_t nargsf, PyObject* kwnames) {
  FastCall* self = reinterpret_cast<FastCall*>(py_self);
  PyObject* result = FastOpCall(self->op, argv, nargsf, kwnames);
  if (result != g_miss) return result;
  Py_DECREF(result);
  return PyObject_Vectorcall(self->fallback, argv, nargsf, kwnames);
}

// The fallback's globals usually hold this FastCall (an eager function's namespace): a cycle
// that only the garbage collector can break.
int FastCallTraverse(PyObject* py_self, visitproc visit, void* arg) {
  FastCall* self = reinterpret_cast<FastCall*>(py_self);
  Py_VISIT(self->op);
  Py_VISIT(self->fallback);
  return 0;
}

int FastCallClear(PyObject* py_self) {
  FastCall* self = reinterpret_cast<FastCall*>(py_self);
  Py_CLEAR(self->op);
  Py_CLEAR(self->fallback);
  return 0;
}

void FastCallDealloc(PyObject* py_self) {
  PyObject_GC_UnTrack(py_self);
  FastCallClear(py_self);
  Py_TYPE(py_self)->tp_free(py_self);
}

PyObject* FastCallGetOp(PyObject* py_self, void*) {
  return Py_NewRef(reinterpret_cast<FastCall*>(py_self)->op);
}

PyObject* FastCallGetFallback(PyObject* py_self, void*) {
  return Py_NewRef(reinterpret_cast<FastCall*>(py_self)->fallback);
}

PyGetSetDef kFastCallGetSet[] = {
    {"op", FastCallGetOp, nullptr, "the FastOp whose plans serve calls", nullptr},
    {"fallback", FastCallGetFallback, nullptr, "what a call no plan serves is passed to", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyTypeObject kFastCallType = {
    PyVarObject_HEAD_INIT(nullptr, 0)
};

PyObject* FastOpWithFallback(PyObject* py_self, PyObject* fallback) {
  if (!PyCallable_Check(fallback)) {
    PyErr_SetString(PyExc_TypeError, "FastOp.with_fallback: the fallback must be callable");
    return nullptr;
  }
  FastCall* call = PyObject_GC_New(FastCall, &kFastCallType);
  if (call == nullptr) return nullptr;
  call->vectorcall = FastCallVectorcall;
  call->op = Py_NewRef(py_self);
  call->fallback = Py_NewRef(fallback);
  PyObject_GC_Track(reinterpret_cast<PyObject*>(call));
  return reinterpret_cast<PyObject*>(call);
}

PyMethodDef kFastOpMethods[] = {
    {"add", FastOpAdd, METH_VARARGS,
     "add(inputs, outputs, args, returns, func, written=(), constants=(), stream_bound=False) -> bool: add a launch plan"},
    {"clear", FastOpClear, METH_NOARGS, "drop every plan"},
    {"plans", FastOpLen, METH_NOARGS, "number of plans held"},
    {"with_fallback", FastOpWithFallback, METH_O,
     "with_fallback(fn) -> callable: a plan's result, or else fn(*args) for a call no plan serves"},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject kFastOpType = {
    PyVarObject_HEAD_INIT(nullptr, 0)
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_launcher", "mslk_dsl native launch path", -1, nullptr};

}  // namespace

// Each FastOp instance is called through vectorcall (no argument tuple is built per call).
struct FastOpVC {
  FastOp op;
  vectorcallfunc vectorcall;
};

static PyObject* NewFastOpVC(PyTypeObject* type, PyObject* argv, PyObject* kwargs) {
  PyObject* self = FastOpNew(type, argv, kwargs);
  if (self != nullptr) reinterpret_cast<FastOpVC*>(self)->vectorcall = FastOpVectorcallEntry;
  return self;
}

PyMODINIT_FUNC PyInit__launcher(void) {
  kFastOpType.tp_name = "mslk_dsl._launcher.FastOp";
  kFastOpType.tp_basicsize = sizeof(FastOpVC);
  kFastOpType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  kFastOpType.tp_doc = "Launch plans of one op, keyed by the exact layout of the call's inputs.";
  kFastOpType.tp_new = NewFastOpVC;
  kFastOpType.tp_dealloc = FastOpDealloc;
  kFastOpType.tp_methods = kFastOpMethods;
  kFastOpType.tp_vectorcall_offset = offsetof(FastOpVC, vectorcall);
  kFastOpType.tp_call = PyVectorcall_Call;
  if (PyType_Ready(&kFastOpType) < 0) return nullptr;
  kFastCallType.tp_name = "mslk_dsl._launcher.FastCall";
  kFastCallType.tp_basicsize = sizeof(FastCall);
  kFastCallType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC;
  kFastCallType.tp_doc = "A FastOp's plans, falling back to a Python function for a call none serves.";
  kFastCallType.tp_dealloc = FastCallDealloc;
  kFastCallType.tp_traverse = FastCallTraverse;
  kFastCallType.tp_clear = FastCallClear;
  kFastCallType.tp_getset = kFastCallGetSet;
  kFastCallType.tp_vectorcall_offset = offsetof(FastCall, vectorcall);
  kFastCallType.tp_call = PyVectorcall_Call;
  if (PyType_Ready(&kFastCallType) < 0) return nullptr;
  PyObject* module = PyModule_Create(&kModule);
  if (module == nullptr) return nullptr;
  g_miss = PyObject_CallNoArgs(reinterpret_cast<PyObject*>(&PyBaseObject_Type));
  PyObject* errors = PyImport_ImportModule("mslk_dsl.errors");
  g_launch_error = errors != nullptr ? PyObject_GetAttrString(errors, "KernelLaunchError") : nullptr;
  Py_XDECREF(errors);
  if (g_launch_error == nullptr) {
    PyErr_Clear();
    g_launch_error = Py_NewRef(PyExc_RuntimeError);
  }
  if (g_miss == nullptr || PyModule_AddObjectRef(module, "MISS", g_miss) < 0 ||
      PyModule_AddObjectRef(module, "FastOp", reinterpret_cast<PyObject*>(&kFastOpType)) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
