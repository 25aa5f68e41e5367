// kernels-triton's RMSNorm and residual add + RMSNorm as C++ autograd nodes launching this package's compiled
// Triton kernels through the CUDA driver. Why: the Python autograd.Function costs 50-70 us of host time per
// backward in the autograd engine's device thread; here a forward is one allocation and one cuLaunchKernel, a
// backward two of each (no saved rstd; input gradient and weight-gradient partials share one allocation). The
// nodes are hand-written like PyTorch's generated ones, without Function/CppNode's generic bookkeeping.
// Triton knowledge is limited to the launcher ABI of Triton 3.3-3.9's CUDA launcher (one slot per non-constexpr
// argument, then the global and profile scratch pointers; 32 * num_warps threads; the kernel's shared memory):
// Python (_cpp_extension.arg_types, called from _cpp_extension._build_norm_plan) reads each compiled kernel's
// signature, refuses clusters, scratch, cooperative or PDL launches, and passes one letter per argument.
// No CUDA headers: the stream comes from c10's device-guard interface, the driver calls from the driver library
// PyTorch has already loaded.

#include <torch/extension.h>

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <dlfcn.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

[[noreturn]] void fail(const std::string& message) {
  // One string argument: c10::str then formats nothing. Formatting numbers through iostreams inside this
  // library crashed (its own copy of the locale facet ids, never initialised), so numbers go through to_string.
  TORCH_CHECK(false, "kernels-triton autograd extension: " + message);
}

void check(int result, const char* call) {
  if (result != 0) {
    fail(std::string(call) + " failed with CUresult " + std::to_string(result));
  }
}

// The few CUDA driver entry points used, from the driver library PyTorch has already loaded.
struct Driver {
  int (*launch_kernel)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                       unsigned block_y, unsigned block_z, unsigned shared_bytes, void* stream, void** params,
                       void** extra);
  int (*context_get_current)(void** context);
  int (*context_set_current)(void* context);
  int (*context_get_device)(int* device);
  int (*device_get)(int* device, int ordinal);
  int (*primary_context_retain)(void** context, int device);
};

template <typename Function>
void resolve(void* library, const char* name, Function& slot) {
  slot = reinterpret_cast<Function>(dlsym(library, name));
  if (slot == nullptr) {
    fail(std::string("libcuda.so.1 has no ") + name);
  }
}

const Driver& driver() {
  static const Driver loaded = [] {
    void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (library == nullptr) {
      library = dlopen("libcuda.so.1", RTLD_NOW);
    }
    if (library == nullptr) {
      fail("cannot open libcuda.so.1");
    }
    Driver functions{};
    resolve(library, "cuLaunchKernel", functions.launch_kernel);
    resolve(library, "cuCtxGetCurrent", functions.context_get_current);
    resolve(library, "cuCtxSetCurrent", functions.context_set_current);
    resolve(library, "cuCtxGetDevice", functions.context_get_device);
    resolve(library, "cuDeviceGet", functions.device_get);
    resolve(library, "cuDevicePrimaryCtxRetain", functions.primary_context_retain);
    return functions;
  }();
  return loaded;
}

// The primary context of each device (the one PyTorch and Triton use), retained once.
void* primary_context(int ordinal) {
  static std::array<void*, 64> contexts{};
  static std::mutex lock;
  if (ordinal < 0 || ordinal >= static_cast<int>(contexts.size())) {
    fail("device ordinal " + std::to_string(ordinal) + " out of range");
  }
  std::lock_guard<std::mutex> guard(lock);
  void*& context = contexts[ordinal];
  if (context == nullptr) {
    const Driver& cuda = driver();
    int handle = 0;
    check(cuda.device_get(&handle, ordinal), "cuDeviceGet");
    check(cuda.primary_context_retain(&context, handle), "cuDevicePrimaryCtxRetain");
  }
  return context;
}

// Makes the device's primary context current for one launch. The autograd engine's device threads select their
// device through the runtime API, which binds no driver context until a runtime call needs one, so there
// cuLaunchKernel would fail with CUDA_ERROR_INVALID_CONTEXT: such a thread keeps the context (as after any
// runtime call). A thread that had another device's context current (a layer on cuda:1 called while cuda:0 is
// current) gets it back afterwards, so the caller's current device does not change under it.
class ContextGuard {
 public:
  explicit ContextGuard(int ordinal) {
    const Driver& cuda = driver();
    void* current = nullptr;
    int device = -1;
    if (cuda.context_get_current(&current) == 0 && current != nullptr && cuda.context_get_device(&device) == 0 &&
        device == ordinal) {
      return;
    }
    check(cuda.context_set_current(primary_context(ordinal)), "cuCtxSetCurrent");
    previous_ = current;
  }
  ~ContextGuard() {
    if (previous_ != nullptr) {
      driver().context_set_current(previous_);
    }
  }
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  void* previous_ = nullptr;
};

// One argument as the caller has it; the kernel's type letter decides how it is stored.
struct Arg {
  enum Kind { kPointer, kInteger, kFloat } kind;
  uint64_t pointer = 0;
  int64_t integer = 0;
  double real = 0.0;

  static Arg of(const at::Tensor& tensor) { return Arg{kPointer, reinterpret_cast<uint64_t>(tensor.data_ptr()), 0, 0.0}; }
  static Arg of(int64_t value) { return Arg{kInteger, 0, value, 0.0}; }
  static Arg of(double value) { return Arg{kFloat, 0, 0, value}; }
};

// The most arguments a kernel here takes (the backward: 11), with room to spare; the parameter slots
// live on the stack, since a launch happens once per layer per direction.
constexpr size_t kMaxArgs = 14;

// A compiled Triton kernel: its driver handle and how to launch it, for one device.
struct Kernel {
  uint64_t function = 0;
  int64_t threads = 0;
  int64_t shared_bytes = 0;
  // One letter per non-constexpr argument: 'p' device pointer, 'i' int32, 'l' int64, 'f' float32.
  std::string arg_types;

  bool loaded() const { return function != 0; }

  void launch(int64_t grid, std::initializer_list<Arg> args, const c10::Device& device) const {
    if (args.size() != arg_types.size()) {
      fail("kernel takes " + std::to_string(arg_types.size()) + " arguments, got " + std::to_string(args.size()));
    }
    // Two more slots: Triton's global and profile scratch pointers, null for these kernels.
    std::array<uint64_t, kMaxArgs + 2> slots{};
    std::array<void*, kMaxArgs + 2> params{};
    size_t index = 0;
    for (const Arg& arg : args) {
      char type = arg_types[index];
      uint64_t& slot = slots[index];
      Arg::Kind expected = type == 'p' ? Arg::kPointer : type == 'f' ? Arg::kFloat : Arg::kInteger;
      if (arg.kind != expected) {
        fail("argument " + std::to_string(index) + " does not match the kernel's type '" + type + "'");
      }
      if (type == 'p') {
        slot = arg.pointer;
      } else if (type == 'i') {
        if (arg.integer < INT32_MIN || arg.integer > INT32_MAX) {
          fail("argument " + std::to_string(index) + " does not fit 32 bits");
        }
        int32_t narrow = static_cast<int32_t>(arg.integer);
        std::memcpy(&slot, &narrow, sizeof(narrow));
      } else if (type == 'l') {
        std::memcpy(&slot, &arg.integer, sizeof(arg.integer));
      } else {
        float narrow = static_cast<float>(arg.real);
        std::memcpy(&slot, &narrow, sizeof(narrow));
      }
      params[index] = &slot;
      ++index;
    }
    params[index] = &slots[index];
    params[index + 1] = &slots[index + 1];
    ContextGuard context(device.index());
    void* stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
    check(driver().launch_kernel(reinterpret_cast<void*>(function), static_cast<unsigned>(grid), 1, 1,
                                 static_cast<unsigned>(threads), 1, 1, static_cast<unsigned>(shared_bytes), stream,
                                 params.data(), nullptr),
          "cuLaunchKernel");
  }
};

}  // namespace

// The kernels of one RMSNorm variant (dtypes, width, Gemma casting, offset) on one device. Python builds one per
// variant and keeps it for the process's life; every autograd node made with it holds a reference too.
struct NormPlan {
  Kernel forward;            // RMSNorm forward, or the residual add + RMSNorm forward
  Kernel backward;           // the backward with no gradient reaching the sum
  Kernel backward_with_sum;  // the residual variant's backward when the sum's gradient is defined
  Kernel sum_partials;       // the weight gradient's per-program rows summed and cast
  int64_t sum_block_columns = 0;
};

// One plan with the launch shapes of one input shape: what Python looks up once per signature and passes to every
// call of that signature.
struct NormCall {
  std::shared_ptr<const NormPlan> plan;
  int64_t forward_grid = 0;
  int64_t programs = 0;          // backward programs, each summing its rows' weight gradient into one partial row
  int64_t rows_per_program = 0;
};

namespace {

using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A contiguous ``sizes`` tensor of ``dtype`` over ``buffer``'s storage from ``byte_offset`` on (a multiple of the
// dtype's size), made without a dispatcher call. The storage lives as long as any tensor over it does.
at::Tensor typed_view(const at::Tensor& buffer, int64_t byte_offset, at::IntArrayRef sizes, at::ScalarType dtype) {
  at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(buffer.storage()), c10::DispatchKeySet(c10::DispatchKey::CUDA), c10::scalarTypeToTypeMeta(dtype));
  c10::TensorImpl* impl = view.unsafeGetTensorImpl();
  impl->set_storage_offset(byte_offset / static_cast<int64_t>(c10::elementSize(dtype)));
  impl->set_sizes_contiguous(sizes);
  return view;
}

// The input gradient (``like``'s shape and dtype) and the float32 [programs, n_cols] weight-gradient partials in one
// allocation: one trip to the caching allocator instead of two per backward. The partials' bytes are freed with
// the gradient, usually by the next node: a few programs per SM, so 1 MiB beside a 16 MiB bfloat16 gradient at
// 8192 x 1024 on an H200 (8.6 MiB beside 128 MiB at 8192 x 8192); a leaf input's .grad keeps them.
std::pair<at::Tensor, at::Tensor> gradient_buffers(const at::Tensor& like, int64_t programs, int64_t n_cols) {
  const int64_t gradient_bytes = like.numel() * static_cast<int64_t>(like.element_size());
  const int64_t partial_offset = cdiv(gradient_bytes, 256) * 256;  // the float32 rows on an aligned boundary
  at::Tensor buffer = at::empty({partial_offset + programs * n_cols * 4}, like.options().dtype(at::kByte));
  return {typed_view(buffer, 0, like.sizes(), like.scalar_type()),
          typed_view(buffer, partial_offset, {programs, n_cols}, at::kFloat)};
}

bool aligned_16(const at::Tensor& tensor) { return reinterpret_cast<uintptr_t>(tensor.data_ptr()) % 16 == 0; }

at::Tensor aligned(const at::Tensor& tensor) {
  // The backward kernels were compiled for 16-byte aligned contiguous gradients (all the caching allocator hands
  // out); an offset view takes a copy.
  at::Tensor dense = tensor.contiguous();
  return aligned_16(dense) ? dense : dense.clone();
}

// The backward of both norms. Its next edges are the forward's differentiable inputs: (x, weight) for RMSNorm,
// (x, residual, weight) for the residual variant, whose normed input is the saved sum.
struct NormBackward : public Node {
  NormBackward(const NormCall& call, bool residual, int64_t n_rows, double eps, double offset)
      : plan(call.plan),
        programs(call.programs),
        rows_per_program(call.rows_per_program),
        n_rows(n_rows),
        eps(eps),
        offset(offset),
        residual(residual) {}

  std::string name() const override {
    return residual ? "KernelsTritonResidualRMSNormBackward" : "KernelsTritonRMSNormBackward";
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    normed_input.reset_data();
    weight.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    // Allocations below go straight to the backend: nothing here records autograd history.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const size_t weight_slot = residual ? 2 : 1;
    variable_list outputs(weight_slot + 1);
    const at::Tensor& dy_in = grads[0];
    const at::Tensor ds_in = residual ? grads[1] : at::Tensor();
    if (!dy_in.defined()) {
      // The normalised output was not used: only the residual variant's sum passes a gradient, unchanged.
      for (size_t slot = 0; residual && slot < weight_slot; ++slot) {
        if (task_should_compute_output(slot)) {
          outputs[slot] = ds_in;
        }
      }
      return outputs;
    }
    const bool want_dw = task_should_compute_output(weight_slot);
    at::Tensor s = normed_input.unpack(getptr());
    at::Tensor w = weight.unpack();
    const int64_t n_cols = s.size(-1);
    at::Tensor dy = aligned(dy_in);
    const bool has_ds = ds_in.defined();
    at::Tensor ds = has_ds ? aligned(ds_in) : dy;
    auto [dx, partial] = gradient_buffers(s, programs, n_cols);
    const Kernel& kernel = has_ds ? plan->backward_with_sum : plan->backward;
    if (!kernel.loaded()) {
      fail("no backward kernel loaded for this plan");
    }
    // The kernel recomputes each row's rstd: its RSTD slot gets dy, never read.
    kernel.launch(programs,
                  {Arg::of(dy), Arg::of(ds), Arg::of(s), Arg::of(w), Arg::of(dy), Arg::of(dx), Arg::of(partial),
                   Arg::of(n_rows), Arg::of(eps), Arg::of(offset), Arg::of(rows_per_program)},
                  s.device());
    if (want_dw) {
      at::Tensor dw = at::empty(w.sizes(), w.options());
      plan->sum_partials.launch(cdiv(n_cols, plan->sum_block_columns),
                                {Arg::of(partial), Arg::of(dw), Arg::of(programs)}, s.device());
      outputs[weight_slot] = dw;
    }
    // dx is the gradient of x and, for the residual variant, of the residual too (the sum's gradient included).
    for (size_t slot = 0; slot < weight_slot; ++slot) {
      if (task_should_compute_output(slot)) {
        outputs[slot] = dx;
      }
    }
    return outputs;
  }

  std::shared_ptr<const NormPlan> plan;
  int64_t programs;
  int64_t rows_per_program;
  int64_t n_rows;
  double eps;
  double offset;
  bool residual;
  SavedVariable normed_input;  // x, or the residual variant's sum (an output of this node)
  SavedVariable weight;
};

// PyTorch holds autograd nodes by std::shared_ptr up to some release and by c10::intrusive_ptr after it; the edge
// type says which this build of torch uses.
using NodePointer = decltype(torch::autograd::Edge{}.function);
template <typename>
struct IsSharedPointer : std::false_type {};
template <typename T>
struct IsSharedPointer<std::shared_ptr<T>> : std::true_type {};

template <typename T, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (IsSharedPointer<NodePointer>::value) {
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...));
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

// Whether the compiled kernels take these tensors as they are: contiguous, 16-byte aligned (what they were
// compiled for), the weight of the input's width on its device. Python looks a call's NormCall up by the input's
// shape, dtypes and device only and leaves these per-call conditions to this check (nanoseconds here, a
// microsecond or more as Python attribute calls); a call that fails it is declined (None) and takes the Python
// path. A call that could never be right (no plan, a CPU input) is an error.
bool takes(const at::Tensor& x, const at::Tensor& weight, const NormCall& call) {
  if (!call.plan) {
    fail("NormCall has no plan");
  }
  if (!x.is_cuda()) {
    fail("expected a CUDA input, got one on " + x.device().str());
  }
  return x.dim() > 0 && x.is_contiguous() && weight.is_contiguous() && weight.device() == x.device() &&
         weight.numel() == x.size(-1) && aligned_16(x) && aligned_16(weight);
}

// Records the backward node for the outputs when autograd needs one; ``saved`` is what the backward normalises
// (x itself, or the residual variant's sum, an output), the outputs get the node as their history.
template <typename... Inputs>
void record_backward(const NormCall& call, bool residual, int64_t n_rows, double eps, double offset,
                     const at::Tensor& saved, bool saved_is_output, const at::Tensor& weight,
                     std::initializer_list<at::Tensor> outputs, const Inputs&... inputs) {
  auto node = make_node<NormBackward>(call, residual, n_rows, eps, offset);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  for (const at::Tensor& output : outputs) {
    torch::autograd::set_history(output, node);
  }
  // After set_history: a saved output refers to its node weakly, which needs the node set first.
  node->normed_input = SavedVariable(saved, saved_is_output);
  node->weight = SavedVariable(weight, false);
}

}  // namespace

std::optional<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset,
                                   const NormCall& call) {
  if (!takes(x, weight, call)) {
    return std::nullopt;
  }
  const bool needs_grad = torch::autograd::compute_requires_grad(x, weight);
  const int64_t n_rows = x.numel() / x.size(-1);
  at::Tensor y;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    y = at::empty_like(x);
    // The forward kernel was compiled to store no rstd: its RSTD slot gets y, never written.
    call.plan->forward.launch(call.forward_grid,
                              {Arg::of(x), Arg::of(weight), Arg::of(y), Arg::of(y), Arg::of(n_rows), Arg::of(eps),
                               Arg::of(offset)},
                              x.device());
  }
  if (needs_grad) {
    record_backward(call, false, n_rows, eps, offset, x, false, weight, {y}, x, weight);
  }
  return y;
}

std::optional<std::vector<at::Tensor>> residual_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                         const at::Tensor& weight, double eps, double offset,
                                                         const NormCall& call) {
  if (!takes(x, weight, call) || !residual.is_contiguous() || residual.sizes() != x.sizes() ||
      residual.device() != x.device() || residual.scalar_type() != x.scalar_type() || !aligned_16(residual)) {
    return std::nullopt;
  }
  const bool needs_grad = torch::autograd::compute_requires_grad(x, residual, weight);
  const int64_t n_rows = x.numel() / x.size(-1);
  at::Tensor y;
  at::Tensor s;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    y = at::empty_like(x);
    s = at::empty_like(x);
    call.plan->forward.launch(call.forward_grid,
                              {Arg::of(x), Arg::of(residual), Arg::of(weight), Arg::of(y), Arg::of(s), Arg::of(y),
                               Arg::of(n_rows), Arg::of(eps), Arg::of(offset)},
                              x.device());
  }
  if (needs_grad) {
    // The sum is an output the layer keeps as its next residual: saving it costs no memory.
    record_backward(call, true, n_rows, eps, offset, s, true, weight, {y, s}, x, residual, weight);
  }
  return std::vector<at::Tensor>{y, s};
}

Kernel make_kernel(uint64_t function, int64_t threads, int64_t shared_bytes, const std::string& arg_types) {
  if (function == 0) {
    fail("null kernel function");
  }
  if (arg_types.size() > kMaxArgs) {
    fail("a kernel with " + std::to_string(arg_types.size()) + " arguments; at most " + std::to_string(kMaxArgs));
  }
  for (char type : arg_types) {
    if (std::string("pilf").find(type) == std::string::npos) {
      fail(std::string("unknown argument type '") + type + "'; allowed: p, i, l, f");
    }
  }
  return Kernel{function, threads, shared_bytes, arg_types};
}

NormCall make_call(std::shared_ptr<NormPlan> plan, int64_t forward_grid, int64_t programs, int64_t rows_per_program) {
  if (!plan || !plan->forward.loaded() || !plan->backward.loaded() || !plan->sum_partials.loaded() ||
      plan->sum_block_columns <= 0) {
    fail("NormCall needs a plan with its forward, backward and sum_partials kernels and sum_block_columns");
  }
  if (forward_grid <= 0 || programs <= 0 || rows_per_program <= 0) {
    fail("NormCall needs a positive forward grid, program count and rows per program");
  }
  return NormCall{std::move(plan), forward_grid, programs, rows_per_program};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  pybind11::class_<Kernel>(module, "Kernel")
      .def(pybind11::init(&make_kernel), pybind11::arg("function"), pybind11::arg("threads"),
           pybind11::arg("shared_bytes"), pybind11::arg("arg_types"))
      .def_readonly("arg_types", &Kernel::arg_types);
  pybind11::class_<NormPlan, std::shared_ptr<NormPlan>>(module, "NormPlan")
      .def(pybind11::init<>())
      .def_readwrite("forward", &NormPlan::forward)
      .def_readwrite("backward", &NormPlan::backward)
      .def_readwrite("backward_with_sum", &NormPlan::backward_with_sum)
      .def_readwrite("sum_partials", &NormPlan::sum_partials)
      .def_readwrite("sum_block_columns", &NormPlan::sum_block_columns);
  pybind11::class_<NormCall>(module, "NormCall")
      .def(pybind11::init(&make_call), pybind11::arg("plan"), pybind11::arg("forward_grid"),
           pybind11::arg("programs"), pybind11::arg("rows_per_program"))
      .def_readonly("forward_grid", &NormCall::forward_grid)
      .def_readonly("programs", &NormCall::programs)
      .def_readonly("rows_per_program", &NormCall::rows_per_program);
  module.def("rms_norm", &rms_norm,
             "RMSNorm forward recording a C++ autograd node (see the file's header); None: inputs declined");
  module.def("residual_rms_norm", &residual_rms_norm,
             "Residual add + RMSNorm forward recording a C++ autograd node; returns [normed, sum], or None: inputs "
             "declined");
}
