// What every kernel shares: the MPI functions, the way back to Python, the
// kernel's state from tracing (Site), the agreement, and reading and writing
// TensorFlow tensors. See collectives.cc for the whole picture.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "tensorflow/c/kernels.h"
#include "tensorflow/c/ops.h"
#include "tensorflow/c/tf_datatype.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"
#include "mpi_strategy_protocol.h"

namespace mpi_strategy_kernels {

using namespace protocol;  // NOLINT (the protocol is these files' vocabulary)

using Handle = intptr_t;

// The MPI functions used, typed with intptr_t handles (see above).
struct Mpi {
  int (*Iallgather)(const void*, int, Handle, void*, int, Handle, Handle, Handle*) = nullptr;
  int (*Wait)(Handle*, void*) = nullptr;
  int (*Allreduce)(const void*, void*, int, Handle, Handle, Handle) = nullptr;
  int (*Bcast)(void*, int, Handle, int, Handle) = nullptr;
  int (*Allgatherv)(const void*, int, Handle, void*, const int*, const int*, Handle,
                    Handle) = nullptr;
  int (*Iallreduce)(const void*, void*, int, Handle, Handle, Handle, Handle*) = nullptr;
  int (*Allgather)(const void*, int, Handle, void*, int, Handle, Handle) = nullptr;
  int (*Alltoall)(const void*, int, Handle, void*, int, Handle, Handle) = nullptr;
  int (*Reduce_scatter)(const void*, void*, const int*, Handle, Handle, Handle) = nullptr;
  int (*Alltoallv)(const void*, const int*, const int*, Handle, void*, const int*, const int*,
                   Handle, Handle) = nullptr;
  int (*Test)(Handle*, int*, void*) = nullptr;
  int (*Isend)(const void*, int, Handle, int, int, Handle, Handle*) = nullptr;
  int (*Iprobe)(int, int, Handle, int*, void*) = nullptr;
  int (*Recv)(void*, int, Handle, int, int, Handle, void*) = nullptr;
  Handle in_place = 0;
  Handle byte = 0;
  Handle int64 = 0;
  Handle max = 0;
};
extern Mpi mpi;

// Python's answer on the error path (protocol.CALLBACK): returns a TF_Code
// (0: go on, the records in `received` are the agreed ones) and writes the message.
extern Resolve resolve;

// A communicator's shared state (shared_state.cc): protocol.State, then,
// when the announcements are on (State.announce_comm), theirs
// (timeouts.Announcements.shared). Python reads and writes it through a
// numpy view; the ordering token serializes every collective of a
// communicator, so one kernel at a time touches it.
struct Block {
  std::vector<int64_t> words;
};
constexpr int64_t kStateFields = sizeof(State) / sizeof(int64_t);
// The block of communicator `engine` (nullptr once Python closed it, or for
// an id of another process), held for as long as the caller keeps it.
std::shared_ptr<Block> Held(int64_t engine);

// Packed buffers handed to TensorFlow as the outputs themselves (no copy
// out), reused once TensorFlow has released every output (as core/buffers.py
// BufferPool: reused memory spares the page faults of fresh pages, and the MPI
// library reuses what it registered for it). `refs`: one for the pool, one
// per output alive; the last one frees the slot's memory.
struct Slot {
  uint8_t* data = nullptr;
  int64_t size = 0;
  std::atomic<int64_t> refs{1};
};

void Release(Slot* slot);
void ReleaseOutput(void* data, size_t len, void* slot);

constexpr size_t kPoolSize = 4;

class Pool {
 public:
  ~Pool() {
    for (Slot* slot : slots_) Release(slot);
  }
  // A free slot of `size` bytes with `users` references taken, or nullptr.
  Slot* Take(int64_t size, int64_t users) {
    for (Slot* slot : slots_) {
      int64_t free = 1;
      if (slot->size == size && slot->refs.compare_exchange_strong(free, 1 + users)) return slot;
    }
    auto* slot = new Slot;
    slot->size = size;
    slot->data = static_cast<uint8_t*>(std::aligned_alloc(64, (size + 63) / 64 * 64));
    if (slot->data == nullptr) {
      delete slot;
      return nullptr;
    }
    if (slots_.size() < kPoolSize) {
      slots_.push_back(slot);
      slot->refs = 1 + users;
    } else {
      slot->refs = users;  // (not pooled: freed with its last output)
    }
    return slot;
  }

 private:
  std::vector<Slot*> slots_;
};

// What a kernel knows from tracing (its op's attributes, protocol.ATTRS:
// `engine` is its communicator, Python's NativeComm.id; `trace` the op name's
// number while a timeline records, else 0), and (`held`, `state`) while it runs.
struct Site : Attrs {
  std::shared_ptr<Block> held;
  State* state = nullptr;  // held's State
  double timeout = 0;  // (timeout_bits) when `timed`
  double agreed = 0;  // Now() when the last agreement completed
  bool done = false;  // the last run succeeded (SetToken)
  std::vector<uint8_t> record, received, scratch;
  std::vector<int64_t> extremes;  // (the hashed agreement's Iallreduce)
  Pool pool;
};

// The agreement (agreement.cc).
// `data`: what Python reads (default: the records gathered, site.received).
bool AskPython(TF_OpKernelContext* ctx, const Site& site, Event event, int64_t value,
               const void* data = nullptr);
bool MpiOk(TF_OpKernelContext* ctx, const Site& site, int rc);
const int64_t* Signature(const Site& site, int64_t rank);
bool Agree(TF_OpKernelContext* ctx, Site& site, int64_t token, const void* data,
           int64_t nbytes, bool* carried, int64_t rows = 0);
const uint8_t* CarriedData(const Site& site, int64_t rank);

// A timeout (timeouts.cc, as core/timeouts.py): before a timed exchange,
// Announce tells the other ranks this collective's number; Complete waits for
// the exchange (polled until the deadline when timed; then Python's timeout
// error, false), then reads the announcements that arrived.
bool Announce(TF_OpKernelContext* ctx, const Site& site);
bool Complete(TF_OpKernelContext* ctx, Site& site, int rc, Handle* request);

// Tensors and ops (collectives.cc).
bool Fail(TF_OpKernelContext* ctx, TF_Status* status);
std::vector<int64_t> Dims(const TF_Tensor* tensor);
bool SetToken(TF_OpKernelContext* ctx, Site& site, TF_Status* status);
int64_t ReadToken(TF_OpKernelContext* ctx, TF_Status* status);
std::vector<TF_Tensor*> Inputs(TF_OpKernelContext* ctx, int n, TF_Status* status);
TF_Tensor* OutputLike(TF_OpKernelContext* ctx, int index, TF_Status* status);
// The timeline (as ArrayCollectives.timed): the clock of Python's
// time.perf_counter, and Python's event for a run of `site` that succeeded.
double Now();
int64_t InputBytes(TF_OpKernelContext* ctx);
void Trace(TF_OpKernelContext* ctx, const Site& site, double started, int64_t nbytes);

// `Compute` on its communicator's state (else Python's error: the
// communicator is gone), timed for the timeline when one records (site.trace).
template <void (*Compute)(void*, TF_OpKernelContext*)>
void Run(void* kernel, TF_OpKernelContext* ctx) {
  Site& site = *static_cast<Site*>(kernel);
  site.held = Held(site.engine);
  if (site.held == nullptr) {
    AskPython(ctx, site, kBlocked, 0);
    return;
  }
  site.state = reinterpret_cast<State*>(site.held->words.data());
  if (site.trace == 0) {
    Compute(kernel, ctx);
  } else {
    site.done = false;
    const double started = Now();
    const int64_t nbytes = InputBytes(ctx);
    Compute(kernel, ctx);
    if (site.done) Trace(ctx, site, started, nbytes);
  }
  site.state = nullptr;
  site.held.reset();
}

// Runs `body(site, input, status)` (true: done) between the agreement and
// the token's step, for a kernel of inputs (token, x) whose data never rides
// in the agreement.
template <typename Body>
void AfterAgreeing(void* kernel, TF_OpKernelContext* ctx, Body body) {
  Site& site = *static_cast<Site*>(kernel);
  TF_Status* status = TF_NewStatus();
  const int64_t token = ReadToken(ctx, status);
  std::vector<TF_Tensor*> inputs = Inputs(ctx, 1, status);
  bool carried = false;
  if (TF_GetCode(status) == TF_OK && Agree(ctx, site, token, nullptr, 0, &carried) &&
      body(site, inputs[0], status)) {
    SetToken(ctx, site, status);
  }
  for (TF_Tensor* input : inputs) TF_DeleteTensor(input);
  TF_DeleteStatus(status);
}

// `input`, `types`: nullptr for none (an op of the token alone); `input` and
// `output` may list several, separated by ";".
void RegisterOp(const char* name, const char* input, const char* output, bool listed,
                void (*compute)(void*, TF_OpKernelContext*), const char* types = "T: type");

}  // namespace mpi_strategy_kernels
