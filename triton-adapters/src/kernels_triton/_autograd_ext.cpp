// kernels-triton's RMSNorm and residual add + RMSNorm as C++ autograd functions that launch this package's
// compiled Triton kernels through the CUDA driver.
//
// Why C++: the Python autograd.Function these replace costs 50-70 us of host time per backward in the autograd
// engine's device thread on an H200 host (GIL, interpreter state moving between cores), more than the GPU time of
// the whole layer below ~33M elements. Here a backward is three allocations and two cuLaunchKernel calls.
//
// What this file knows about Triton is the launcher ABI shared by Triton 3.3-3.9's CUDA launcher: one parameter
// slot per non-constexpr kernel argument (device pointers, 32/64-bit integers, float32 scalars as their bits),
// then the global and profile scratch pointers; 32 * num_warps threads; the compiled kernel's shared memory.
// Python (_cpp_extension.arg_types, called from _triton_kernels._build_norm_plan) reads each compiled kernel's
// signature and metadata, refuses anything else (clusters, scratch, cooperative or PDL launches), and hands over
// the function handle with one letter per argument.
//
// No CUDA headers: the stream comes from c10's device-guard interface, cuLaunchKernel and the context calls from
// the driver library that PyTorch has already loaded.

#include <torch/extension.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <string>
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

// The autograd engine's device threads select the device through the runtime API, which binds no driver context
// until a runtime call needs one: cuLaunchKernel there fails with CUDA_ERROR_INVALID_CONTEXT. Make the device's
// primary context (the one PyTorch and Triton use) current, as Triton's own launcher does.
void make_context_current(int ordinal) {
  const Driver& cuda = driver();
  void* context = nullptr;
  int device = -1;
  if (cuda.context_get_current(&context) == 0 && context != nullptr && cuda.context_get_device(&device) == 0 &&
      device == ordinal) {
    return;
  }
  int handle = 0;
  check(cuda.device_get(&handle, ordinal), "cuDeviceGet");
  check(cuda.primary_context_retain(&context, handle), "cuDevicePrimaryCtxRetain");
  check(cuda.context_set_current(context), "cuCtxSetCurrent");
}

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

// A compiled Triton kernel: its driver handle and how to launch it, for one device.
struct Kernel {
  uint64_t function = 0;
  int64_t threads = 0;
  int64_t shared_bytes = 0;
  // One letter per non-constexpr argument: 'p' device pointer, 'i' int32, 'l' int64, 'f' float32.
  std::string arg_types;

  bool loaded() const { return function != 0; }

  void launch(int64_t grid, const std::vector<Arg>& args, const c10::Device& device) const {
    if (args.size() != arg_types.size()) {
      fail("kernel takes " + std::to_string(arg_types.size()) + " arguments, got " + std::to_string(args.size()));
    }
    // Two more slots: Triton's global and profile scratch pointers, null for these kernels.
    std::vector<uint64_t> slots(args.size() + 2, 0);
    std::vector<void*> params(slots.size());
    for (size_t index = 0; index < args.size(); ++index) {
      const Arg& arg = args[index];
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
    }
    params[args.size()] = &slots[args.size()];
    params[args.size() + 1] = &slots[args.size() + 1];
    make_context_current(device.index());
    void* stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
    check(driver().launch_kernel(reinterpret_cast<void*>(function), static_cast<unsigned>(grid), 1, 1,
                                 static_cast<unsigned>(threads), 1, 1, static_cast<unsigned>(shared_bytes), stream,
                                 params.data(), nullptr),
          "cuLaunchKernel");
  }
};

}  // namespace

// The kernels of one RMSNorm variant (dtypes, width, Gemma casting, offset) on one device. Python builds one per
// variant, keeps it for the process's life and passes it to every call.
struct NormPlan {
  Kernel forward;            // RMSNorm forward, or the residual add + RMSNorm forward
  Kernel backward;           // the backward with no gradient reaching the sum
  Kernel backward_with_sum;  // the residual variant's backward when the sum's gradient is defined
  Kernel sum_partials;       // the weight gradient's per-program rows summed and cast
  int64_t sum_block_columns = 0;
};

namespace {

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

at::Tensor aligned(const at::Tensor& tensor) {
  // The backward kernels were compiled for 16-byte aligned contiguous gradients (all the caching allocator hands
  // out); an offset view takes a copy.
  at::Tensor dense = tensor.contiguous();
  if (reinterpret_cast<uintptr_t>(dense.data_ptr()) % 16 != 0) {
    return dense.clone();
  }
  return dense;
}

const NormPlan& plan_of(const torch::autograd::AutogradContext* ctx) {
  return *reinterpret_cast<const NormPlan*>(ctx->saved_data.at("plan").toInt());
}

// The shared backward: dx (also the residual's gradient) and, if wanted, the weight gradient.
std::pair<at::Tensor, at::Tensor> norm_backward(torch::autograd::AutogradContext* ctx, const at::Tensor& dy_in,
                                                const at::Tensor& ds_in, bool want_dw) {
  const NormPlan& plan = plan_of(ctx);
  auto saved = ctx->get_saved_variables();
  const at::Tensor& s = saved[0];
  const at::Tensor& weight = saved[1];
  const at::Tensor& rstd = saved[2];
  const int64_t n_rows = ctx->saved_data.at("n_rows").toInt();
  const int64_t programs = ctx->saved_data.at("programs").toInt();
  const int64_t rows_per_program = ctx->saved_data.at("rows_per_program").toInt();
  const double offset = ctx->saved_data.at("offset").toDouble();
  const int64_t n_cols = s.size(-1);

  at::Tensor dy = aligned(dy_in);
  bool has_ds = ds_in.defined();
  at::Tensor ds = has_ds ? aligned(ds_in) : dy;
  at::Tensor dx = at::empty_like(s);
  at::Tensor partial = at::empty({programs, n_cols}, s.options().dtype(at::kFloat));
  const Kernel& backward = has_ds ? plan.backward_with_sum : plan.backward;
  if (!backward.loaded()) {
    fail("no backward kernel loaded for this plan");
  }
  backward.launch(programs,
                  {Arg::of(dy), Arg::of(ds), Arg::of(s), Arg::of(weight), Arg::of(rstd), Arg::of(dx),
                   Arg::of(partial), Arg::of(n_rows), Arg::of(offset), Arg::of(rows_per_program)},
                  s.device());
  at::Tensor dw;
  if (want_dw) {
    dw = at::empty(weight.sizes(), weight.options());
    plan.sum_partials.launch(cdiv(n_cols, plan.sum_block_columns),
                             {Arg::of(partial), Arg::of(dw), Arg::of(programs)}, s.device());
  }
  return {dx, dw};
}

void save_launch_state(torch::autograd::AutogradContext* ctx, const NormPlan& plan, int64_t n_rows,
                       int64_t programs, int64_t rows_per_program, double offset) {
  ctx->saved_data["plan"] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(&plan));
  ctx->saved_data["n_rows"] = n_rows;
  ctx->saved_data["programs"] = programs;
  ctx->saved_data["rows_per_program"] = rows_per_program;
  ctx->saved_data["offset"] = offset;
}

struct RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            double eps, double offset, const NormPlan* plan, int64_t forward_grid, int64_t programs,
                            int64_t rows_per_program) {
    const int64_t n_rows = x.numel() / x.size(-1);
    at::Tensor y = at::empty_like(x);
    at::Tensor rstd = at::empty({n_rows}, x.options().dtype(at::kFloat));
    plan->forward.launch(forward_grid,
                         {Arg::of(x), Arg::of(weight), Arg::of(y), Arg::of(rstd), Arg::of(n_rows), Arg::of(eps),
                          Arg::of(offset)},
                         x.device());
    ctx->save_for_backward({x, weight, rstd});
    save_launch_state(ctx, *plan, n_rows, programs, rows_per_program, offset);
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto [dx, dw] = norm_backward(ctx, grads[0], at::Tensor(), ctx->needs_input_grad(1));
    return {dx, dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct ResidualRMSNormFunction : public torch::autograd::Function<ResidualRMSNormFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& residual, const at::Tensor& weight, double eps,
                                                double offset, const NormPlan* plan, int64_t forward_grid,
                                                int64_t programs, int64_t rows_per_program) {
    const int64_t n_rows = x.numel() / x.size(-1);
    at::Tensor y = at::empty_like(x);
    at::Tensor s = at::empty_like(x);
    at::Tensor rstd = at::empty({n_rows}, x.options().dtype(at::kFloat));
    plan->forward.launch(forward_grid,
                         {Arg::of(x), Arg::of(residual), Arg::of(weight), Arg::of(y), Arg::of(s), Arg::of(rstd),
                          Arg::of(n_rows), Arg::of(eps), Arg::of(offset)},
                         x.device());
    // The sum is an output the layer keeps as its next residual: saving it costs no memory.
    ctx->save_for_backward({s, weight, rstd});
    save_launch_state(ctx, *plan, n_rows, programs, rows_per_program, offset);
    ctx->set_materialize_grads(false);
    return {y, s};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& dy = grads[0];
    const at::Tensor& ds = grads[1];
    bool need_x = ctx->needs_input_grad(0);
    bool need_residual = ctx->needs_input_grad(1);
    at::Tensor dx;
    at::Tensor dw;
    if (!dy.defined()) {
      // The normalised output was not used: only the sum's gradient flows, unchanged.
      dx = ds;
    } else {
      std::tie(dx, dw) = norm_backward(ctx, dy, ds, ctx->needs_input_grad(2));
    }
    return {need_x ? dx : at::Tensor(), need_residual ? dx : at::Tensor(), dw, at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset, const NormPlan& plan,
                    int64_t forward_grid, int64_t programs, int64_t rows_per_program) {
  return RMSNormFunction::apply(x, weight, eps, offset, &plan, forward_grid, programs, rows_per_program);
}

std::vector<at::Tensor> residual_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                          double eps, double offset, const NormPlan& plan, int64_t forward_grid,
                                          int64_t programs, int64_t rows_per_program) {
  return ResidualRMSNormFunction::apply(x, residual, weight, eps, offset, &plan, forward_grid, programs,
                                        rows_per_program);
}

Kernel make_kernel(uint64_t function, int64_t threads, int64_t shared_bytes, const std::string& arg_types) {
  if (function == 0) {
    fail("null kernel function");
  }
  for (char type : arg_types) {
    if (std::string("pilf").find(type) == std::string::npos) {
      fail(std::string("unknown argument type '") + type + "'; allowed: p, i, l, f");
    }
  }
  return Kernel{function, threads, shared_bytes, arg_types};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  pybind11::class_<Kernel>(module, "Kernel")
      .def(pybind11::init(&make_kernel), pybind11::arg("function"), pybind11::arg("threads"),
           pybind11::arg("shared_bytes"), pybind11::arg("arg_types"))
      .def_readonly("arg_types", &Kernel::arg_types);
  pybind11::class_<NormPlan>(module, "NormPlan")
      .def(pybind11::init<>())
      .def_readwrite("forward", &NormPlan::forward)
      .def_readwrite("backward", &NormPlan::backward)
      .def_readwrite("backward_with_sum", &NormPlan::backward_with_sum)
      .def_readwrite("sum_partials", &NormPlan::sum_partials)
      .def_readwrite("sum_block_columns", &NormPlan::sum_block_columns);
  module.def("rms_norm", &rms_norm, "RMSNorm forward with a C++ autograd node (see the file's header)");
  module.def("residual_rms_norm", &residual_rms_norm,
             "Residual add + RMSNorm forward with a C++ autograd node; returns [normed, sum]");
}
