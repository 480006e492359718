// sdcwatch's DDP communication hook in C++ (checksums/native_hook.py builds and loads it).
//
// What GradSummaries' Python hook does for each gradient bucket, with no Python in the steady state: on a
// side stream that waits for the backward's (when one is given), launch the bucket's bound summary kernel
// (a compiled Triton kernel, its arguments fixed once the bucket's layout settled), then all-reduce the
// bucket through DDP's process group and hand DDP the collective's future. A bucket without a bound launch
// (the first calls, a moved buffer, the CPU, fault injection) calls the Python fallback, which summarises
// it on the current stream (and may bind it); the reduction is done here either way. DDP calls a Python
// hook through the GIL with a GradBucket object, a future and a `then` callback a bucket: on the H200's
// host that cost ~130 us a bucket inside a step, more than the checks themselves (docs/BENCHMARKS.md).
//
// Once armed (`arm_gather`, `arm_finish`), the hook of the last bucket also all-gathers every rank's rows,
// replays the compute gate's verdict graph on them and copies the rows and the verdict's flag to a pinned
// host slot, all on its stream: the step guard's stage before the update then only makes its stream wait.
//
// No CUDA header is needed: streams and events go through c10's device-generic guard interface, and the
// kernel and graph launches through the driver's cuLaunchKernel and cuGraphLaunch, looked up in the libcuda
// the process already loaded.

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/utils/pybind.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using CUresult = int;
using LaunchFn = CUresult (*)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                              unsigned bz, unsigned shared, void* stream, void** params, void** extra);
using ParamInfoFn = CUresult (*)(void* f, size_t index, size_t* offset, size_t* size);
using GraphLaunchFn = CUresult (*)(void* exec, void* stream);

struct Driver {
  LaunchFn launch = nullptr;
  ParamInfoFn param_info = nullptr;
  GraphLaunchFn graph_launch = nullptr;
  std::string why;
};

const Driver& driver() {
  static Driver d = [] {
    Driver out;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);   // only the one CUDA already loaded
    if (lib == nullptr) {
      out.why = "libcuda.so.1 is not loaded in this process";
      return out;
    }
    out.launch = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
    out.param_info = reinterpret_cast<ParamInfoFn>(dlsym(lib, "cuFuncGetParamInfo"));
    out.graph_launch = reinterpret_cast<GraphLaunchFn>(dlsym(lib, "cuGraphLaunch"));
    if (out.launch == nullptr) {
      out.why = "the CUDA driver has no cuLaunchKernel";
    } else if (out.param_info == nullptr) {
      out.why = "the CUDA driver has no cuFuncGetParamInfo (a driver older than CUDA 12.4)";
    }
    return out;
  }();
  return d;
}

// kinds of a kernel argument, as Python passes them
constexpr int kInt64 = 0;   // a device address or a 64-bit integer
constexpr int kInt32 = 1;
constexpr int kFloat32 = 2;

// a bucket's summary launch, every argument fixed: the packed parameter buffer cuLaunchKernel copies
struct Bound {
  int64_t ptr = 0;
  int64_t numel = 0;
  void* function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 32;
  unsigned shared = 0;
  std::vector<char> params;
};

struct Side {
  c10::Stream stream;
  void* ready = nullptr;   // recorded on the backward's stream, waited on by `stream`
};

// the compute gate's step after the rows' gather (`arm_finish`): its verdict graph replayed on the gather's
// output, then the rows and the flag copied to the next pinned host slot, each slot's event recorded after
struct Finish {
  void* exec = nullptr;              // the verdict's instantiated CUDA graph (cudaGraphExec_t)
  at::Tensor input;                  // the graph's input: the gather's output, [world * n, words]
  at::Tensor flag;                   // the graph's output, 0-d float32
  std::vector<at::Tensor> keep;      // what else the graph reads (the spread): kept alive while armed
  std::vector<at::Tensor> host_rows; // pinned [world * n, words] slots, used in turn
  std::vector<at::Tensor> host_flag; // pinned 0-d float32 slots
  std::vector<void*> events;         // each slot's CUDA event (the caller's torch.cuda.Event's handle)
  void* ready = nullptr;             // recorded after the graph: the caller's stream waits for it
  size_t next = 0;                   // the slot of the next step
  // (`ready` is left to the process's end, as the side streams' events are: one an arming, a few a job; a
  // hook destroyed while the interpreter and CUDA shut down must not call into them)
};

class SummaryHook : public c10d::CommHookInterface {
 public:
  SummaryHook(c10::intrusive_ptr<c10d::ProcessGroup> pg, py::object fallback, py::object prepare,
              bool side_on)
      : pg_(std::move(pg)), fallback_(std::move(fallback)), prepare_(std::move(prepare)),
        side_on_(side_on) {}

  ~SummaryHook() override {
    // the hook dies with DDP's reducer: the Python objects are let go under the GIL, or left alone when
    // the interpreter is shutting down (nothing may take the GIL then)
#if PY_VERSION_HEX >= 0x030D0000
    const bool finalizing = Py_IsFinalizing();
#else
    const bool finalizing = _Py_IsFinalizing();
#endif
    if (!Py_IsInitialized() || finalizing) {
      fallback_.release();
      prepare_.release();
      return;
    }
    try {
      py::gil_scoped_acquire gil;
      fallback_ = py::object();
      prepare_ = py::object();
    } catch (...) {
    }
  }

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor& buf = bucket.getBufferRef();
    const size_t idx = bucket.getIndex();
    const bool cuda = buf.is_cuda();
    const c10::impl::DeviceGuardImplInterface* impl = nullptr;
    std::optional<c10::Stream> previous;
    Side* side = nullptr;
    if (cuda && side_on_) {
      const c10::DeviceIndex dev = buf.device().index();
      side = side_for(dev);
      if (side == nullptr) {   // the device's first bucket: Python makes its side stream (set_side)
        py::gil_scoped_acquire gil;
        prepare_(static_cast<int>(dev));
        side = side_for(dev);
      }
      if (side != nullptr) {
        impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
        const c10::Stream current = impl->getStream(buf.device());
        // the bucket's gradients are ready on the backward's stream: the side stream waits for them
        impl->record(&side->ready, current, dev, c10::EventFlag::PYTORCH_DEFAULT);
        impl->block(side->ready, side->stream);
        previous = impl->exchangeStream(side->stream);   // the summary and the collective run there
      }
    }
    try {
      if (!(cuda && launch_bound(idx, buf))) {
        py::gil_scoped_acquire gil;
        fallback_(static_cast<int64_t>(idx), buf, bucket.getParameters());
      } else {
        native_calls_.fetch_add(1, std::memory_order_relaxed);
      }
      const bool last = mark(idx);
      std::vector<at::Tensor> tensors{buf};
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp::SUM;
      auto work = pg_->allreduce(tensors, opts);
      auto fut = work->getFuture();
      if (last) gather_rows();
      if (previous) impl->exchangeStream(*previous);
      return fut;
    } catch (...) {
      if (previous) impl->exchangeStream(*previous);
      throw;
    }
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    return c10d::detail::parseCppCommHookResult(result);
  }

  // ---- from Python (under the GIL) ----

  void set_side(int dev, int64_t stream_id, int device_type) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto s = c10::Stream::unpack3(stream_id, static_cast<c10::DeviceIndex>(dev),
                                        static_cast<c10::DeviceType>(device_type));
    for (auto& side : sides_) {
      if (side->stream.device_index() == s.device_index()) {
        side->stream = s;
        return;
      }
    }
    sides_.push_back(std::make_unique<Side>(Side{s, nullptr}));
  }

  // bind bucket `idx`'s launch; "" when bound, else why not (nothing bound)
  std::string bind(int64_t idx, int64_t ptr, int64_t numel, int64_t function, std::vector<int64_t> grid,
                   int64_t block, int64_t shared, const std::vector<std::pair<int, py::object>>& args) {
    const Driver& d = driver();
    if (!d.why.empty()) return d.why;
    if (idx < 0 || grid.size() != 3 || function == 0 || block <= 0) return "a malformed launch";
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (static_cast<size_t>(idx) < refused_.size() && !refused_[idx].empty()) return refused_[idx];
    }
    Bound b;
    b.ptr = ptr;
    b.numel = numel;
    b.function = reinterpret_cast<void*>(function);
    for (int i = 0; i < 3; ++i) b.grid[i] = static_cast<unsigned>(grid[i]);
    b.block = static_cast<unsigned>(block);
    b.shared = static_cast<unsigned>(shared);
    // the kernel's own parameter list (offsets, sizes): each given argument must fill one exactly, and
    // the parameters after them (Triton's scratch pointers) must be 8-byte addresses, passed as null
    size_t i = 0;
    for (;; ++i) {
      size_t off = 0, size = 0;
      if (d.param_info(b.function, i, &off, &size) != 0) break;   // past the last parameter
      if (b.params.size() < off + size) b.params.resize(off + size, 0);
      if (i >= args.size()) {   // Triton's global and profile scratch pointers: at most two, null
        if (size != 8) return "the kernel has a parameter after its arguments that is not an address";
        if (i >= args.size() + 2) return "the kernel has more than two parameters after its arguments";
        continue;
      }
      const auto& [kind, value] = args[i];
      char* at = b.params.data() + off;
      if (kind == kFloat32) {
        if (size != 4) return "argument " + std::to_string(i) + " (fp32) fills a " + std::to_string(size) +
                              "-byte parameter";
        const float v = value.cast<float>();
        std::memcpy(at, &v, 4);
      } else if (kind == kInt32) {
        if (size != 4) return "argument " + std::to_string(i) + " (i32) fills a " + std::to_string(size) +
                              "-byte parameter";
        const int64_t wide = value.cast<int64_t>();   // a u32 above INT32_MAX keeps its bits
        const uint32_t v = static_cast<uint32_t>(wide);
        std::memcpy(at, &v, 4);
      } else if (kind == kInt64) {
        if (size != 8) return "argument " + std::to_string(i) + " (i64) fills a " + std::to_string(size) +
                              "-byte parameter";
        const int64_t v = value.cast<int64_t>();
        std::memcpy(at, &v, 8);
      } else {
        return "argument " + std::to_string(i) + " of an unknown kind";
      }
    }
    if (i < args.size()) {
      return "the kernel takes " + std::to_string(i) + " parameters, given " + std::to_string(args.size());
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (bound_.size() <= static_cast<size_t>(idx)) bound_.resize(idx + 1);
    bound_[idx] = std::make_unique<Bound>(std::move(b));
    return "";
  }

  void unbind_all() {
    std::lock_guard<std::mutex> lock(mu_);
    bound_.clear();
  }

  std::vector<int64_t> bound() {
    std::lock_guard<std::mutex> lock(mu_);
    return set_indices(bound_);
  }

  std::vector<int64_t> reduced() {
    std::lock_guard<std::mutex> lock(mu_);
    return set_indices(reduced_);
  }

  int64_t reduced_count() {   // the highest bucket index reduced since the last clear, plus one (0: none)
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = reduced_.size(); i > 0; --i) {
      if (reduced_[i - 1]) return static_cast<int64_t>(i);
    }
    return 0;
  }

  void clear() {
    std::lock_guard<std::mutex> lock(mu_);
    std::fill(reduced_.begin(), reduced_.end(), false);
    gather_work_.reset();
    finished_ = -1;
  }

  // the rows' all-gather, issued by the hook of bucket n-1 once buckets 0..n-1 (and no other) were reduced
  // this step, right after that bucket's all-reduce, on the same stream: `rows` ([n, words], the rows'
  // buffer) into `out` ([world * n, words]) over `pg`. Every rank arms it at the same step (its
  // GradSummaries agree on it through a collective), so each issues it at the same point of its sequence
  // of collectives: the step's eager all-gather, moved from the step guard's Python into the backward.
  void arm_gather(c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Tensor out, at::Tensor rows, int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    gather_pg_ = std::move(pg);
    gather_out_ = std::move(out);
    gather_in_ = std::move(rows);
    gather_n_ = n;
    gather_work_.reset();
  }

  void disarm_gather() {
    std::lock_guard<std::mutex> lock(mu_);
    gather_pg_.reset();
    gather_out_ = at::Tensor();
    gather_in_ = at::Tensor();
    gather_n_ = 0;
    gather_work_.reset();
    finish_.reset();          // it replays on the gather's output
    finished_ = -1;
  }

  // from the next gather on (CUDA), the verdict graph `exec` (reading `input`, the armed gather's output,
  // and `keep`; writing `flag`) is launched on the hook's stream right after the gather, then the rows and
  // the flag are copied to host slot `start`, `start` + 1, ... in turn, each slot's event recorded after
  // its copies; "" when armed, else why not (nothing armed)
  std::string arm_finish(int64_t exec, at::Tensor input, at::Tensor flag, std::vector<at::Tensor> keep,
                         std::vector<at::Tensor> host_rows, std::vector<at::Tensor> host_flag,
                         std::vector<int64_t> events, int64_t start) {
    const Driver& d = driver();
    if (!d.why.empty()) return d.why;
    if (d.graph_launch == nullptr) return "the CUDA driver has no cuGraphLaunch";
    if (exec == 0 || !input.is_cuda() || !flag.is_cuda() || flag.numel() != 1) return "a malformed verdict";
    const size_t n = host_rows.size();
    if (n == 0 || host_flag.size() != n || events.size() != n || start < 0 ||
        static_cast<size_t>(start) >= n) {
      return "malformed host slots";
    }
    for (size_t i = 0; i < n; ++i) {
      if (host_rows[i].is_cuda() || host_rows[i].sizes() != input.sizes() ||
          host_rows[i].scalar_type() != input.scalar_type() || host_flag[i].numel() != 1 ||
          host_flag[i].scalar_type() != flag.scalar_type() || events[i] == 0) {
        return "host slot " + std::to_string(i) + " does not fit the rows";
      }
    }
    auto f = std::make_unique<Finish>();
    f->exec = reinterpret_cast<void*>(exec);
    f->input = std::move(input);
    f->flag = std::move(flag);
    f->keep = std::move(keep);
    f->host_rows = std::move(host_rows);
    f->host_flag = std::move(host_flag);
    for (int64_t e : events) f->events.push_back(reinterpret_cast<void*>(e));
    f->next = static_cast<size_t>(start);
    std::lock_guard<std::mutex> lock(mu_);
    if (!gather_pg_ || gather_out_.data_ptr() != f->input.data_ptr()) {
      return "the rows' gather is not armed there";
    }
    finish_ = std::move(f);
    finished_ = -1;
    return "";
  }

  void disarm_finish() {
    std::lock_guard<std::mutex> lock(mu_);
    finish_.reset();
    finished_ = -1;
  }

  bool finished() {   // the hook's verdict ran since the last clear (`wait_gather` then blocks nothing)
    std::lock_guard<std::mutex> lock(mu_);
    return finished_ >= 0 && finish_ != nullptr;
  }

  // what the hook did since the last clear: -2 no gather (or not over exactly buckets 0..n-1 any more: a
  // bucket reduced after the gather's); -1 the gather only; k >= 0 the gather, the verdict and the copies
  // into host slot k. The caller's current stream (NCCL) or the host (gloo) waits for the gather, and for
  // the verdict when it ran.
  int64_t wait_gather() {
    c10::intrusive_ptr<c10d::Work> work;
    int64_t finished = -1;
    void* ready = nullptr;
    c10::Device dev = c10::Device(c10::DeviceType::CPU);
    bool exact = true;
    {
      std::lock_guard<std::mutex> lock(mu_);
      work = std::move(gather_work_);
      gather_work_.reset();
      finished = finished_;
      finished_ = -1;
      if (finished >= 0 && finish_) {
        ready = finish_->ready;
        dev = finish_->input.device();
      }
      for (size_t i = 0; i < reduced_.size(); ++i) {
        if (reduced_[i] != (static_cast<int64_t>(i) < gather_n_)) exact = false;
      }
    }
    if (!work) return -2;
    if (ready != nullptr) {   // recorded after the hook's stream waited for the gather: one wait for both
      const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      impl->block(ready, impl->getStream(dev));
    } else {
      work->wait();
    }
    if (!exact) return -2;
    return ready != nullptr ? finished : -1;
  }

  int64_t native_calls() const { return native_calls_.load(std::memory_order_relaxed); }


 private:
  Side* side_for(c10::DeviceIndex dev) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& side : sides_) {
      if (side->stream.device_index() == dev) return side.get();   // stable: each Side is its own allocation
    }
    return nullptr;
  }

  template <typename V>
  static std::vector<int64_t> set_indices(const V& v) {   // the indices whose entry is set
    std::vector<int64_t> out;
    for (size_t i = 0; i < v.size(); ++i) {
      if (v[i]) out.push_back(static_cast<int64_t>(i));
    }
    return out;
  }

  // bucket `idx` reduced this step; true when it completes an armed gather's buckets 0..n-1 (no other)
  bool mark(size_t idx) {
    std::lock_guard<std::mutex> lock(mu_);
    if (reduced_.size() <= idx) reduced_.resize(idx + 1, false);
    reduced_[idx] = true;
    if (gather_n_ <= 0 || static_cast<int64_t>(idx) + 1 != gather_n_) return false;
    for (size_t i = 0; i < reduced_.size(); ++i) {
      if (reduced_[i] != (static_cast<int64_t>(i) < gather_n_)) return false;
    }
    return true;
  }

  void gather_rows() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!gather_pg_) return;
    // `_allgather_base`: every torch this builds against has it (2.13 names it all_gather_single too)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    gather_work_ = gather_pg_->_allgather_base(gather_out_, gather_in_);
#pragma GCC diagnostic pop
    finished_ = -1;
    if (finish_ && gather_out_.is_cuda()) finish_step(*finish_);
  }

  // the verdict and the copies on the current (the hook's) stream, after the gather; a launch the driver
  // refuses disarms it (the caller's stage then replays the verdict itself, as before arming)
  void finish_step(Finish& f) {
    if (f.input.data_ptr() != gather_out_.data_ptr()) {   // re-armed elsewhere: not this verdict's input
      finish_.reset();
      return;
    }
    try {
      const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      const c10::Device dev = gather_out_.device();
      const c10::Stream stream = impl->getStream(dev);
      gather_work_->wait();                                 // NCCL: this stream waits; the host does not
      if (driver().graph_launch(f.exec, stream.native_handle()) != 0) {
        finish_.reset();
        return;
      }
      impl->record(&f.ready, stream, dev.index(), c10::EventFlag::PYTORCH_DEFAULT);
      const size_t k = f.next;
      f.host_rows[k].copy_(f.input, /*non_blocking=*/true);
      f.host_flag[k].copy_(f.flag, /*non_blocking=*/true);
      impl->record(&f.events[k], stream, dev.index(), c10::EventFlag::PYTORCH_DEFAULT);   // into its handle
      f.next = (k + 1) % f.host_rows.size();
      finished_ = static_cast<int64_t>(k);
    } catch (...) {        // never a broken backward: the stage replays the verdict itself, as before arming
      finish_.reset();
      finished_ = -1;
    }
  }

  // the bucket's bound launch on the current stream; false (nothing launched) when it has none, its
  // buffer moved or resized, or the driver refused it (then the bucket is unbound: Python rebinds or not)
  bool launch_bound(size_t idx, const at::Tensor& buf) {
    std::lock_guard<std::mutex> lock(mu_);
    if (idx >= bound_.size() || !bound_[idx]) return false;
    Bound& b = *bound_[idx];
    if (b.ptr != reinterpret_cast<int64_t>(buf.data_ptr()) || b.numel != buf.numel()) {
      bound_[idx].reset();
      return false;
    }
    const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    void* stream = impl->getStream(buf.device()).native_handle();
    size_t size = b.params.size();
    void* extra[] = {reinterpret_cast<void*>(1), b.params.data(),    // CU_LAUNCH_PARAM_BUFFER_POINTER
                     reinterpret_cast<void*>(2), &size,              // CU_LAUNCH_PARAM_BUFFER_SIZE
                     nullptr};                                       // CU_LAUNCH_PARAM_END
    const CUresult rc = driver().launch(b.function, b.grid[0], b.grid[1], b.grid[2], b.block, 1, 1,
                                        b.shared, stream, nullptr, extra);
    if (rc != 0) {
      if (refused_.size() <= idx) refused_.resize(idx + 1);   // said when Python next asks to bind it
      refused_[idx] = "cuLaunchKernel returned " + std::to_string(rc) + " for bucket " + std::to_string(idx);
      bound_[idx].reset();
      return false;
    }
    return true;
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  py::object fallback_;
  py::object prepare_;
  const bool side_on_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Bound>> bound_;
  std::vector<bool> reduced_;
  std::vector<std::unique_ptr<Side>> sides_;
  std::vector<std::string> refused_;     // a bucket's launch the driver refused: why (never bound again)
  c10::intrusive_ptr<c10d::ProcessGroup> gather_pg_;   // the armed rows' all-gather (`arm_gather`)
  at::Tensor gather_out_;
  at::Tensor gather_in_;
  int64_t gather_n_ = 0;
  c10::intrusive_ptr<c10d::Work> gather_work_;       // issued since the last clear, not yet waited for
  std::unique_ptr<Finish> finish_;                    // the verdict after the gather (`arm_finish`)
  int64_t finished_ = -1;                             // the host slot the hook's verdict went to this step
  std::atomic<int64_t> native_calls_{0};
};

// what DDP's reducer owns: the hook, shared with Python's handle (either may outlive the other)
class Registered : public c10d::CommHookInterface {
 public:
  explicit Registered(std::shared_ptr<SummaryHook> hook) : hook_(std::move(hook)) {}
  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    return hook_->runHook(bucket);
  }
  at::Tensor parseHookResult(const c10::IValue& result) override { return hook_->parseHookResult(result); }

 private:
  std::shared_ptr<SummaryHook> hook_;
};

// Python's handle: not an owner (the hook holds Python's callbacks, which hold the handle's owner: owning
// the hook from Python would be a cycle through C++ that no collector sees, keeping the model's parameters)
struct Handle {
  std::weak_ptr<SummaryHook> hook;

  std::shared_ptr<SummaryHook> get() const { return hook.lock(); }   // null once DDP's reducer is gone
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "sdcwatch's C++ DDP communication hook (checksums/native_hook.py)";
  py::class_<Handle>(m, "Handle")
      .def("set_side", [](Handle& h, int dev, int64_t id, int type) {
             if (auto hook = h.get()) hook->set_side(dev, id, type);
           })
      .def("bind", [](Handle& h, int64_t idx, int64_t ptr, int64_t numel, int64_t fn,
                      std::vector<int64_t> grid, int64_t block, int64_t shared,
                      std::vector<std::pair<int, py::object>> args) -> std::string {
             auto hook = h.get();
             if (!hook) return "the hook is gone (its DDP model was collected)";
             return hook->bind(idx, ptr, numel, fn, std::move(grid), block, shared, args);
           })
      .def("unbind_all", [](Handle& h) {
             if (auto hook = h.get()) hook->unbind_all();
           })
      .def("bound", [](Handle& h) {
             auto hook = h.get();
             return hook ? hook->bound() : std::vector<int64_t>{};
           })
      .def("reduced", [](Handle& h) {
             auto hook = h.get();
             return hook ? hook->reduced() : std::vector<int64_t>{};
           })
      .def("reduced_count", [](Handle& h) -> int64_t {
             auto hook = h.get();
             return hook ? hook->reduced_count() : 0;
           })
      .def("clear", [](Handle& h) {
             if (auto hook = h.get()) hook->clear();
           })
      .def("arm_gather", [](Handle& h, const c10::intrusive_ptr<c10d::ProcessGroup>& pg, at::Tensor out,
                            at::Tensor rows, int64_t n) {
             if (auto hook = h.get()) hook->arm_gather(pg, std::move(out), std::move(rows), n);
           })
      .def("disarm_gather", [](Handle& h) {
             if (auto hook = h.get()) hook->disarm_gather();
           })
      .def("wait_gather", [](Handle& h) -> int64_t {
             auto hook = h.get();
             if (!hook) return -2;
             if (hook->finished()) return hook->wait_gather();   // a stream wait only: the GIL is kept
             py::gil_scoped_release nogil;   // gloo's wait blocks the host
             return hook->wait_gather();
           })
      .def("arm_finish", [](Handle& h, int64_t exec, at::Tensor input, at::Tensor flag,
                            std::vector<at::Tensor> keep, std::vector<at::Tensor> host_rows,
                            std::vector<at::Tensor> host_flag, std::vector<int64_t> events,
                            int64_t start) -> std::string {
             auto hook = h.get();
             if (!hook) return "the hook is gone (its DDP model was collected)";
             return hook->arm_finish(exec, std::move(input), std::move(flag), std::move(keep),
                                     std::move(host_rows), std::move(host_flag), std::move(events), start);
           })
      .def("disarm_finish", [](Handle& h) {
             if (auto hook = h.get()) hook->disarm_finish();
           })
      .def("native_calls", [](Handle& h) { auto hook = h.get(); return hook ? hook->native_calls() : 0; })
      .def("alive", [](Handle& h) { return !h.hook.expired(); });
  m.def(
      "register",
      [](c10d::Reducer& reducer, const c10::intrusive_ptr<c10d::ProcessGroup>& pg, py::object fallback,
         py::object prepare, bool side_on) {
        auto hook = std::make_shared<SummaryHook>(pg, std::move(fallback), std::move(prepare), side_on);
        Handle handle{hook};
        reducer.register_comm_hook(std::make_unique<Registered>(std::move(hook)));   // the one owner
        return handle;
      },
      "Register the hook on DDP's reducer (DDP takes one hook); its handle");
  m.def("driver_why", [] { return driver().why; }, "Why kernels cannot be launched here ('' when they can)");
}
