// mpi_strategy's native collectives: TensorFlow kernels written against TF's
// stable C API (tensorflow/c/kernels.h, ops.h), never its C++ framework
// headers, so one source builds against every TensorFlow release since 2.16.
//
// Each kernel does in C what core/collectives.py does in Python, byte for
// byte: the same agreement record (a signature of int64 fields, then carried
// data), the same non-blocking Allgather of it,
// the same MPI call for the data, the same order of operations when small
// data is reduced from the records. A rank on this path and a rank on the
// Python path therefore meet in the same collectives and compute the same
// bits. Python runs only when tracing (the static parts of the signature
// become attributes) and on the error path: a disagreement, an MPI error or a
// retired communicator calls back into Python (ctypes), which writes the same
// messages and chooses the same error classes as the Python path.
//
// The wire protocol's constants (the signature's fields, the shared state's
// layout, event and op codes, the hash's constants, alignments) are not
// written here: they come from core/protocol.py, as the header the build
// generates, and mpi_strategy_protocol() reports them as compiled, which the
// loader compares with Python's before any kernel runs.
//
// MPI is not linked: the kernel finds MPI's functions through the library
// mpi4py loaded (dlopen RTLD_NOLOAD + dlsym), and takes every handle
// (communicators, datatypes, ops, MPI_IN_PLACE) from mpi4py as an integer.
// MPICH's handles are ints and Open MPI's are pointers; both travel here as
// intptr_t, which the C calling conventions of x86-64 and aarch64 pass in the
// same registers (an int callee reads the low half). One build therefore
// serves every MPI mpi4py can load.
//
// GPU: a device-memory variant would register the same ops for DEVICE_GPU
// and pass device pointers to a CUDA-aware MPI (see docs/concepts.md).

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "tensorflow/c/kernels.h"
#include "tensorflow/c/ops.h"
#include "tensorflow/c/tf_datatype.h"
#include "tensorflow/c/tf_status.h"
#include "tensorflow/c/tf_tensor.h"
#include "mpi_strategy_protocol.h"

namespace {

using namespace protocol;  // NOLINT (the protocol is this file's vocabulary)

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
  Handle in_place = 0;
  Handle byte = 0;
  Handle int64 = 0;
  Handle max = 0;
};
Mpi mpi;

// Python's answer on the error path: returns a TF_Code (0: go on, the
// records in `received` are the agreed ones) and writes the message.
using Resolve = int (*)(int64_t engine, int64_t event, int64_t site, void* received,
                        int64_t value, char* message, int64_t capacity);
Resolve resolve = nullptr;

// State: the per-communicator state, shared with Python (an int64 array
// Python owns, protocol.State); the ordering token serializes every
// collective of a communicator, so one kernel at a time touches it.

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

void Release(Slot* slot) {
  if (slot->refs.fetch_sub(1) == 1) {
    std::free(slot->data);
    delete slot;
  }
}

void ReleaseOutput(void* /*data*/, size_t /*len*/, void* slot) { Release(static_cast<Slot*>(slot)); }

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

// What a kernel knows from tracing.
struct Site {
  State* state = nullptr;
  int64_t site = 0, kind = 0, dtype_code = 0, count = 0, tensors = 0, layout = 0, root = 0;
  int64_t op = kSum;  // (protocol.Op)
  int64_t contiguous = 0;  // 1: tensors packed back to back (as concatenated)
  Handle mpi_dtype = 0, mpi_op = 0;
  std::vector<uint8_t> record, received, scratch;
  Pool pool;
};

int64_t Attr(TF_OpKernelConstruction* ctx, const char* name, TF_Status* status) {
  int64_t value = 0;
  TF_OpKernelConstruction_GetAttrInt64(ctx, name, &value, status);
  return value;
}

void* Create(TF_OpKernelConstruction* ctx) {
  TF_Status* status = TF_NewStatus();
  auto* site = new Site;
  site->state = reinterpret_cast<State*>(Attr(ctx, "state", status));
  site->site = Attr(ctx, "site", status);
  site->kind = Attr(ctx, "kind", status);
  site->dtype_code = Attr(ctx, "dtype_code", status);
  site->count = Attr(ctx, "count", status);
  site->tensors = Attr(ctx, "tensors", status);
  site->layout = Attr(ctx, "layout", status);
  site->root = Attr(ctx, "root", status);
  site->op = Attr(ctx, "op", status);
  site->contiguous = Attr(ctx, "contiguous", status);
  site->mpi_dtype = static_cast<Handle>(Attr(ctx, "mpi_dtype", status));
  site->mpi_op = static_cast<Handle>(Attr(ctx, "mpi_op", status));
  if (TF_GetCode(status) != TF_OK) TF_OpKernelConstruction_Failure(ctx, status);
  TF_DeleteStatus(status);
  return site;
}

void Delete(void* site) { delete static_cast<Site*>(site); }

// Asks Python; false (and the error set on the context) unless it says go on.
bool AskPython(TF_OpKernelContext* ctx, const Site& site, Event event, int64_t value) {
  std::string message(4096, '\0');
  int code = resolve(site.state->engine, event, site.site,
                     const_cast<uint8_t*>(site.received.data()), value, message.data(),
                     static_cast<int64_t>(message.size()));
  if (code == TF_OK) return true;
  message.resize(strnlen(message.c_str(), message.size()));
  TF_Status* status = TF_NewStatus();
  TF_SetStatus(status, static_cast<TF_Code>(code), message.c_str());
  TF_OpKernelContext_Failure(ctx, status);
  TF_DeleteStatus(status);
  return false;
}

bool MpiOk(TF_OpKernelContext* ctx, const Site& site, int rc) {
  return rc == 0 || AskPython(ctx, site, kMpiError, rc);
}

const int64_t* Signature(const Site& site, int64_t rank) {
  return reinterpret_cast<const int64_t*>(site.received.data() +
                                          rank * site.state->record_bytes);
}

constexpr int kMustAgreeBytes = 8 * (kMustAgreeLast - kMustAgreeFirst + 1);

// The hashed agreement's hash of the fields that must agree (protocol.hash_of).
int64_t HashOf(const int64_t* signature) {
  uint64_t h = kFnvOffset;
  const auto* bytes = reinterpret_cast<const uint8_t*>(signature + kMustAgreeFirst);
  for (int i = 0; i < kMustAgreeBytes; ++i) h = (h ^ bytes[i]) * kFnvPrime;
  return static_cast<int64_t>(h >> 1);
}

// Every rank learns a notice from the same exchange: the first one is kept
// (Rendezvous._heard).
void Heard(State& state, int64_t notice) {
  if (notice != 0 && state.noticed == 0) {
    state.noticed = notice;
    state.noticed_at = state.seq;
  }
}

bool Wait(TF_OpKernelContext* ctx, const Site& site, int rc, Handle* request) {
  alignas(16) unsigned char status[64];  // (larger than any MPI's MPI_Status)
  if (rc == 0) rc = mpi.Wait(request, status);
  return MpiOk(ctx, site, rc);
}

// Above protocol.HASHED_ABOVE ranks: whether every rank's hash is this
// one's (one Allreduce, max, of (hash, -hash, notice)).
bool HashesAgree(TF_OpKernelContext* ctx, const Site& site, const int64_t* signature,
                 bool* agreed) {
  int64_t extremes[3] = {HashOf(signature), -HashOf(signature), signature[kNotice]};
  Handle request = 0;
  int rc = mpi.Iallreduce(reinterpret_cast<void*>(mpi.in_place), extremes, 3, mpi.int64, mpi.max,
                          static_cast<Handle>(site.state->agree_comm), &request);
  if (!Wait(ctx, site, rc, &request)) return false;
  Heard(*site.state, extremes[2]);
  *agreed = extremes[0] == -extremes[1];
  return true;
}

// The agreement (Rendezvous.agree_carrying): returns false on error (set on
// the context); `carried` is true when every rank's data is in the records.
bool Agree(TF_OpKernelContext* ctx, Site& site, int64_t token, const void* data,
           int64_t nbytes, bool* carried, int64_t rows = 0) {
  State& state = *site.state;
  if (state.blocked && !AskPython(ctx, site, kBlocked, 0)) return false;
  const int64_t size = state.size, record_bytes = state.record_bytes;
  site.record.assign(record_bytes, 0);
  site.received.resize(size * record_bytes);
  state.seq += 1;
  const int64_t step = token - state.token;
  state.token = token;
  int64_t signature[kFields] = {};
  signature[kSeq] = state.seq;
  signature[kKind] = site.kind;
  signature[kDtype] = site.dtype_code;
  signature[kCount] = site.count;
  signature[kTensors] = site.tensors;
  signature[kLayout] = site.layout;
  signature[kSolo] = state.solo;
  signature[kToken] = step;
  signature[kRows] = rows;
  signature[kBytes] = nbytes;
  signature[kNotice] = state.notice;
  std::memcpy(site.record.data(), signature, kSignatureBytes);
  if (nbytes <= state.carry_bytes && nbytes > 0 && !state.hashed) {
    std::memcpy(site.record.data() + kSignatureBytes, data, nbytes);
  }
  *carried = false;
  if (state.hashed) {
    bool agreed = false;
    if (!HashesAgree(ctx, site, signature, &agreed)) return false;
    if (agreed) return true;  // (else every record, to explain the disagreement)
  }
  Handle request = 0;
  int rc = mpi.Iallgather(site.record.data(), static_cast<int>(record_bytes), mpi.byte,
                          site.received.data(), static_cast<int>(record_bytes), mpi.byte,
                          static_cast<Handle>(state.agree_comm), &request);
  if (!Wait(ctx, site, rc, &request)) return false;
  const int64_t* first = Signature(site, 0);
  bool differ = false;
  int64_t notice = 0;
  for (int64_t r = 0; r < size; ++r) {
    const int64_t* theirs = Signature(site, r);
    differ |= std::memcmp(theirs + kMustAgreeFirst, first + kMustAgreeFirst, kMustAgreeBytes) != 0;
    notice = std::max(notice, theirs[kNotice]);
  }
  Heard(state, notice);
  // Python settles a disagreement: it raises, or (a save some ranks are in)
  // meets again until this collective agrees, leaving the records here.
  if (differ && !AskPython(ctx, site, kDisagreement, 0)) return false;
  if (state.hashed) return true;
  *carried = true;
  for (int64_t r = 0; r < size; ++r) *carried &= Signature(site, r)[kBytes] <= state.carry_bytes;
  return true;
}

const uint8_t* CarriedData(const Site& site, int64_t rank) {
  return site.received.data() + rank * site.state->record_bytes + kSignatureBytes;
}

// numpy's ufuncs, element by element, in rank order (as collectives.py).
template <typename T>
T Combine(int64_t op, T a, T b) {
  switch (op) {
    case kMin:
      if constexpr (std::is_floating_point_v<T>) return (a <= b || std::isnan(a)) ? a : b;
      return a <= b ? a : b;
    case kMax:
      if constexpr (std::is_floating_point_v<T>) return (a >= b || std::isnan(a)) ? a : b;
      return a >= b ? a : b;
    case kProduct:
      return static_cast<T>(a * b);
    default:
      return static_cast<T>(a + b);
  }
}

template <typename T>
void ReduceRows(const Site& site, void* buffer, int64_t nbytes) {
  T* out = static_cast<T*>(buffer);
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(T));
  std::memcpy(out, CarriedData(site, 0), nbytes);
  for (int64_t r = 1; r < site.state->size; ++r) {
    const uint8_t* row = CarriedData(site, r);
    for (int64_t i = 0; i < n; ++i) {
      T value;
      std::memcpy(&value, row + i * sizeof(T), sizeof(T));
      out[i] = Combine<T>(site.op, out[i], value);
    }
  }
}

void ReduceCarried(const Site& site, TF_DataType dtype, void* buffer, int64_t nbytes) {
  switch (dtype) {
    case TF_FLOAT: return ReduceRows<float>(site, buffer, nbytes);
    case TF_DOUBLE: return ReduceRows<double>(site, buffer, nbytes);
    case TF_INT32: return ReduceRows<int32_t>(site, buffer, nbytes);
    case TF_INT64: return ReduceRows<int64_t>(site, buffer, nbytes);
    case TF_INT8: return ReduceRows<int8_t>(site, buffer, nbytes);
    case TF_UINT8: return ReduceRows<uint8_t>(site, buffer, nbytes);
    case TF_INT16: return ReduceRows<int16_t>(site, buffer, nbytes);
    case TF_UINT16: return ReduceRows<uint16_t>(site, buffer, nbytes);
    case TF_UINT32: return ReduceRows<uint32_t>(site, buffer, nbytes);
    case TF_UINT64: return ReduceRows<uint64_t>(site, buffer, nbytes);
    default: return;  // (the binding sends only these)
  }
}

bool Fail(TF_OpKernelContext* ctx, TF_Status* status) {
  if (TF_GetCode(status) == TF_OK) return false;
  TF_OpKernelContext_Failure(ctx, status);
  return true;
}

std::vector<int64_t> Dims(const TF_Tensor* tensor) {
  std::vector<int64_t> dims(TF_NumDims(tensor));
  for (size_t d = 0; d < dims.size(); ++d) dims[d] = TF_Dim(tensor, static_cast<int>(d));
  return dims;
}

// Input 0 is the ordering token; output 0 is the token plus one.
bool SetToken(TF_OpKernelContext* ctx, TF_Status* status) {
  TF_Tensor* token = nullptr;
  TF_GetInput(ctx, 0, &token, status);
  if (Fail(ctx, status)) return false;
  TF_Tensor* next = TF_AllocateOutput(ctx, 0, TF_INT64, nullptr, 0, 8, status);
  if (!Fail(ctx, status)) {
    *static_cast<int64_t*>(TF_TensorData(next)) = *static_cast<int64_t*>(TF_TensorData(token)) + 1;
  }
  TF_DeleteTensor(token);
  TF_DeleteTensor(next);
  return TF_GetCode(status) == TF_OK;
}

int64_t ReadToken(TF_OpKernelContext* ctx, TF_Status* status) {
  TF_Tensor* token = nullptr;
  TF_GetInput(ctx, 0, &token, status);
  if (Fail(ctx, status)) return 0;
  const int64_t value = *static_cast<int64_t*>(TF_TensorData(token));
  TF_DeleteTensor(token);
  return value;
}

// Inputs 1..n (the caller deletes them); on an error, those read so far.
std::vector<TF_Tensor*> Inputs(TF_OpKernelContext* ctx, int n, TF_Status* status) {
  std::vector<TF_Tensor*> inputs;
  for (int i = 1; i <= n && TF_GetCode(status) == TF_OK; ++i) {
    TF_Tensor* input = nullptr;
    TF_GetInput(ctx, i, &input, status);
    if (!Fail(ctx, status)) inputs.push_back(input);
  }
  return inputs;
}

// Output `index` holding input `index` (forwarded when TensorFlow allows).
TF_Tensor* OutputLike(TF_OpKernelContext* ctx, int index, TF_Status* status) {
  TF_Tensor* input = nullptr;
  TF_GetInput(ctx, index, &input, status);
  if (Fail(ctx, status)) return nullptr;
  std::vector<int64_t> dims = Dims(input);
  int forwarded = -1;
  TF_Tensor* output = TF_ForwardInputOrAllocateOutput(
      ctx, &index, 1, index, dims.data(), static_cast<int>(dims.size()), &forwarded, status);
  if (!Fail(ctx, status) && forwarded < 0 && TF_TensorByteSize(input) > 0) {
    std::memcpy(TF_TensorData(output), TF_TensorData(input), TF_TensorByteSize(input));
  }
  TF_DeleteTensor(input);
  return output;
}

bool ReduceInPlace(TF_OpKernelContext* ctx, Site& site, int64_t token, TF_DataType dtype,
                   void* buffer, int64_t nbytes);

// Small tensors, back to back (the bytes of their concatenation, as the
// Python engine sends them): reduced in a scratch buffer, copied out.
void AllreduceContiguous(TF_OpKernelContext* ctx, Site& site, int64_t token,
                         const std::vector<TF_Tensor*>& inputs, TF_Status* status) {
  int64_t nbytes = 0;
  for (TF_Tensor* input : inputs) nbytes += TF_TensorByteSize(input);
  site.scratch.resize(nbytes);
  int64_t at = 0;
  for (TF_Tensor* input : inputs) {
    if (TF_TensorByteSize(input) > 0) {
      std::memcpy(site.scratch.data() + at, TF_TensorData(input), TF_TensorByteSize(input));
    }
    at += TF_TensorByteSize(input);
  }
  const TF_DataType dtype = TF_TensorType(inputs[0]);
  if (!ReduceInPlace(ctx, site, token, dtype, site.scratch.data(), nbytes)) return;
  at = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<int64_t> dims = Dims(inputs[i]);
    const int64_t size = TF_TensorByteSize(inputs[i]);
    TF_Tensor* out = TF_AllocateOutput(ctx, static_cast<int>(i) + 1, dtype, dims.data(),
                                       static_cast<int>(dims.size()), size, status);
    if (Fail(ctx, status)) return;
    if (size > 0) std::memcpy(TF_TensorData(out), site.scratch.data() + at, size);
    at += size;
    TF_DeleteTensor(out);
  }
  SetToken(ctx, status);
}

void AllreducePacked(TF_OpKernelContext* ctx, Site& site, int64_t token, int n,
                     TF_Status* status) {
  std::vector<TF_Tensor*> inputs = Inputs(ctx, n, status);
  if (TF_GetCode(status) == TF_OK) {
    const TF_DataType dtype = TF_TensorType(inputs[0]);
    if (site.contiguous) {
      AllreduceContiguous(ctx, site, token, inputs, status);
      for (TF_Tensor* input : inputs) TF_DeleteTensor(input);
      return;
    }
    const int64_t align = std::max<int64_t>(kPackAlign, TF_DataTypeSize(dtype));
    std::vector<int64_t> starts;
    int64_t nbytes = 0;
    for (TF_Tensor* input : inputs) {
      nbytes = (nbytes + align - 1) / align * align;
      starts.push_back(nbytes);
      nbytes += TF_TensorByteSize(input);
    }
    Slot* slot = site.pool.Take(nbytes, n);
    if (slot == nullptr) {
      TF_SetStatus(status, TF_RESOURCE_EXHAUSTED, "mpi_strategy: cannot allocate the buffer");
      Fail(ctx, status);
    } else {
      for (int i = 0; i < n; ++i) {
        const int64_t size = TF_TensorByteSize(inputs[i]);
        const int64_t end = i + 1 < n ? starts[i + 1] : nbytes;
        if (size > 0) std::memcpy(slot->data + starts[i], TF_TensorData(inputs[i]), size);
        std::memset(slot->data + starts[i] + size, 0, end - starts[i] - size);
      }
      int handed = 0;
      if (ReduceInPlace(ctx, site, token, dtype, slot->data, nbytes)) {
        for (; handed < n && TF_GetCode(status) == TF_OK; ++handed) {
          std::vector<int64_t> dims = Dims(inputs[handed]);
          TF_Tensor* out = TF_NewTensor(dtype, dims.data(), static_cast<int>(dims.size()),
                                        slot->data + starts[handed],
                                        TF_TensorByteSize(inputs[handed]), &ReleaseOutput, slot);
          TF_SetOutput(ctx, handed + 1, out, status);
          TF_DeleteTensor(out);  // (the output holds the slot now)
        }
        if (!Fail(ctx, status)) SetToken(ctx, status);
      }
      for (int i = handed; i < n; ++i) Release(slot);  // (the outputs not handed out)
    }
  }
  for (TF_Tensor* input : inputs) TF_DeleteTensor(input);
}

// Reduces `buffer` (`nbytes` of `dtype`) in place over the ranks.
bool ReduceInPlace(TF_OpKernelContext* ctx, Site& site, int64_t token, TF_DataType dtype,
                   void* buffer, int64_t nbytes) {
  bool carried = false;
  if (!Agree(ctx, site, token, buffer, nbytes, &carried)) return false;
  if (carried) {
    ReduceCarried(site, dtype, buffer, nbytes);
    return true;
  }
  const int64_t elements = nbytes / TF_DataTypeSize(dtype);
  return MpiOk(ctx, site,
               mpi.Allreduce(reinterpret_cast<void*>(mpi.in_place), buffer,
                             static_cast<int>(elements), site.mpi_dtype, site.mpi_op,
                             static_cast<Handle>(site.state->data_comm)));
}

// Allreduce: inputs (token, x_1..x_N of one dtype), outputs (token + 1, the
// reductions). One tensor is reduced in its own (forwarded) buffer. Several
// are packed as core/buffers.py packs them (each start 64-byte aligned, the
// gaps zero, the buffer ending with the last tensor) into a pooled buffer,
// reduced by one MPI call, and handed out as the outputs (views of it).
void AllreduceCompute(void* kernel, TF_OpKernelContext* ctx) {
  Site& site = *static_cast<Site*>(kernel);
  TF_Status* status = TF_NewStatus();
  const int n = TF_NumInputs(ctx) - 1;
  const int64_t token = ReadToken(ctx, status);
  if (n == 1 && TF_GetCode(status) == TF_OK) {
    TF_Tensor* out = OutputLike(ctx, 1, status);
    if (TF_GetCode(status) == TF_OK &&
        ReduceInPlace(ctx, site, token, TF_TensorType(out), TF_TensorData(out),
                      TF_TensorByteSize(out))) {
      SetToken(ctx, status);
    }
    if (out != nullptr) TF_DeleteTensor(out);
  } else if (TF_GetCode(status) == TF_OK) {
    AllreducePacked(ctx, site, token, n, status);
  }
  TF_DeleteStatus(status);
}

// Broadcast: inputs (token, x), outputs (token + 1, x as on rank `root`).
void BroadcastCompute(void* kernel, TF_OpKernelContext* ctx) {
  Site& site = *static_cast<Site*>(kernel);
  TF_Status* status = TF_NewStatus();
  const int64_t token = ReadToken(ctx, status);
  TF_Tensor* out = TF_GetCode(status) == TF_OK ? OutputLike(ctx, 1, status) : nullptr;
  if (TF_GetCode(status) == TF_OK) {
    void* buffer = TF_TensorData(out);
    const int64_t nbytes = TF_TensorByteSize(out);
    bool carried = false;
    bool ok = Agree(ctx, site, token, buffer, nbytes, &carried);
    if (ok && carried) {
      if (nbytes > 0) std::memcpy(buffer, CarriedData(site, site.root), nbytes);
    } else if (ok) {
      ok = MpiOk(ctx, site,
                 mpi.Bcast(buffer, static_cast<int>(nbytes), mpi.byte,
                           static_cast<int>(site.root),
                           static_cast<Handle>(site.state->data_comm)));
    }
    if (ok) SetToken(ctx, status);
  }
  if (out != nullptr) TF_DeleteTensor(out);
  TF_DeleteStatus(status);
}

int64_t Padded(int64_t nbytes) { return (nbytes + kPieceAlign - 1) / kPieceAlign * kPieceAlign; }

// What one rank sends in an all-gather (core/wire.py concat_bytes): its row
// count of each tensor, then each tensor's bytes, each piece padded to kPieceAlign.
struct Rows {
  std::vector<int64_t> rows, row_bytes;
  int64_t total_rows = 0;
};

Rows Pack(const std::vector<TF_Tensor*>& inputs, std::vector<uint8_t>* mine) {
  const int n = static_cast<int>(inputs.size());
  Rows pack{std::vector<int64_t>(n), std::vector<int64_t>(n)};
  int64_t nbytes = 8 * n;
  for (int i = 0; i < n; ++i) {
    pack.rows[i] = TF_NumDims(inputs[i]) ? TF_Dim(inputs[i], 0) : 1;
    int64_t row = TF_DataTypeSize(TF_TensorType(inputs[i]));
    for (int d = 1; d < TF_NumDims(inputs[i]); ++d) row *= TF_Dim(inputs[i], d);
    pack.row_bytes[i] = row;
    nbytes += Padded(pack.rows[i] * row);
    pack.total_rows += pack.rows[i];
  }
  mine->assign(nbytes, 0);
  std::memcpy(mine->data(), pack.rows.data(), 8 * n);
  int64_t at = 8 * n;
  for (int i = 0; i < n; ++i) {
    const int64_t size = pack.rows[i] * pack.row_bytes[i];
    if (size > 0) std::memcpy(mine->data() + at, TF_TensorData(inputs[i]), size);
    at += Padded(size);
  }
  return pack;
}

// Every rank's bytes, back to back in rank order (`starts`: where each begins).
bool Gather(TF_OpKernelContext* ctx, Site& site, const std::vector<uint8_t>& mine, bool carried,
            std::vector<uint8_t>* everyone, std::vector<int>* starts) {
  const int64_t size = site.state->size;
  int64_t nbytes = static_cast<int64_t>(mine.size());
  std::vector<int64_t> sizes(size);
  for (int64_t r = 0; r < size; ++r) sizes[r] = Signature(site, r)[kBytes];
  if (site.state->hashed &&  // (the hash agreed: no record says the sizes)
      !MpiOk(ctx, site,
             mpi.Allgather(&nbytes, 1, mpi.int64, sizes.data(), 1, mpi.int64,
                           static_cast<Handle>(site.state->agree_comm)))) {
    return false;
  }
  std::vector<int> counts(size);
  starts->resize(size);
  int64_t total = 0;
  for (int64_t r = 0; r < size; ++r) {
    counts[r] = static_cast<int>(sizes[r]);
    (*starts)[r] = static_cast<int>(total);
    total += counts[r];
  }
  everyone->resize(total);
  if (carried) {
    for (int64_t r = 0; r < size; ++r) {
      std::memcpy(everyone->data() + (*starts)[r], CarriedData(site, r), counts[r]);
    }
    return true;
  }
  return MpiOk(ctx, site,
               mpi.Allgatherv(mine.data(), static_cast<int>(nbytes), mpi.byte, everyone->data(),
                              counts.data(), starts->data(), mpi.byte,
                              static_cast<Handle>(site.state->data_comm)));
}

// Output i + 1: every rank's rows of input i, in rank order.
bool Unpack(TF_OpKernelContext* ctx, const std::vector<TF_Tensor*>& inputs, const Rows& pack,
            const std::vector<uint8_t>& everyone, const std::vector<int>& starts,
            TF_Status* status) {
  const int n = static_cast<int>(inputs.size());
  for (int i = 0; i < n; ++i) {
    int64_t out_rows = 0;
    for (int start : starts) out_rows += reinterpret_cast<const int64_t*>(&everyone[start])[i];
    std::vector<int64_t> dims = Dims(inputs[i]);
    if (dims.empty()) dims.push_back(1);
    dims[0] = out_rows;
    TF_Tensor* out = TF_AllocateOutput(ctx, i + 1, TF_TensorType(inputs[i]), dims.data(),
                                       static_cast<int>(dims.size()),
                                       out_rows * pack.row_bytes[i], status);
    if (Fail(ctx, status)) return false;
    int64_t done = 0;
    for (int start : starts) {
      const auto* their_rows = reinterpret_cast<const int64_t*>(&everyone[start]);
      int64_t offset = start + 8 * n;
      for (int j = 0; j < i; ++j) offset += Padded(their_rows[j] * pack.row_bytes[j]);
      const int64_t piece = their_rows[i] * pack.row_bytes[i];
      if (piece > 0) {
        std::memcpy(static_cast<uint8_t*>(TF_TensorData(out)) + done, &everyone[offset], piece);
      }
      done += piece;
    }
    TF_DeleteTensor(out);
  }
  return true;
}

// Allgather: inputs (token, x_1..x_N, any dtypes), outputs (token + 1, each
// x_i concatenated along axis 0 over the ranks, in rank order; rows may
// differ per rank).
void AllgatherCompute(void* kernel, TF_OpKernelContext* ctx) {
  Site& site = *static_cast<Site*>(kernel);
  TF_Status* status = TF_NewStatus();
  const int n = TF_NumInputs(ctx) - 1;
  const int64_t token = ReadToken(ctx, status);
  std::vector<TF_Tensor*> inputs = Inputs(ctx, n, status);
  if (TF_GetCode(status) == TF_OK) {
    std::vector<uint8_t>& mine = site.scratch;
    const Rows pack = Pack(inputs, &mine);
    bool carried = false;
    std::vector<uint8_t> everyone;
    std::vector<int> starts;
    if (Agree(ctx, site, token, mine.data(), static_cast<int64_t>(mine.size()), &carried,
              pack.total_rows) &&
        Gather(ctx, site, mine, carried, &everyone, &starts) &&
        Unpack(ctx, inputs, pack, everyone, starts, status)) {
      SetToken(ctx, status);
    }
  }
  for (TF_Tensor* input : inputs) TF_DeleteTensor(input);
  TF_DeleteStatus(status);
}

void UnknownShapes(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  TF_ShapeInferenceContextSetUnknownShape(ctx, status);
}

const char* kIntAttrs[] = {"state: int", "site: int", "kind: int", "dtype_code: int",
                           "count: int", "tensors: int", "layout: int", "root: int = 0",
                           "op: int = 0", "mpi_dtype: int = 0", "mpi_op: int = 0",
                           "contiguous: int = 0"};

// `types`: "T: type" (one dtype) plus "N: int" when `listed`, or "T: list(type)".
void RegisterOp(const char* name, const char* input, const char* output, bool listed,
                void (*compute)(void*, TF_OpKernelContext*), const char* types = "T: type") {
  TF_Status* status = TF_NewStatus();
  TF_OpDefinitionBuilder* op = TF_NewOpDefinitionBuilder(name);
  TF_OpDefinitionBuilderAddInput(op, "token: int64");
  TF_OpDefinitionBuilderAddInput(op, input);
  TF_OpDefinitionBuilderAddOutput(op, "next_token: int64");
  TF_OpDefinitionBuilderAddOutput(op, output);
  TF_OpDefinitionBuilderAddAttr(op, types);
  if (listed) TF_OpDefinitionBuilderAddAttr(op, "N: int >= 1");
  for (const char* attr : kIntAttrs) TF_OpDefinitionBuilderAddAttr(op, attr);
  TF_OpDefinitionBuilderSetIsStateful(op, true);
  TF_OpDefinitionBuilderSetShapeInferenceFunction(op, &UnknownShapes);
  TF_RegisterOpDefinition(op, status);
  TF_KernelBuilder* kernel = TF_NewKernelBuilder(name, "CPU", &Create, compute, &Delete);
  TF_RegisterKernelBuilder(name, kernel, status);
  TF_DeleteStatus(status);
}

struct Registration {
  Registration() {
    RegisterOp("MpiStrategyAllreduce", "inputs: N * T", "outputs: N * T", true,
               &AllreduceCompute);
    RegisterOp("MpiStrategyBroadcast", "input: T", "output: T", false, &BroadcastCompute);
    RegisterOp("MpiStrategyAllgather", "inputs: T", "outputs: T", false, &AllgatherCompute,
               "T: list(type)");
  }
} registration;

}  // namespace

// The protocol's constants as compiled (protocol.fingerprint()'s format): the
// loader refuses a library whose report differs from Python's.
extern "C" const char* mpi_strategy_protocol() {
  static const std::string report = Describe();
  return report.c_str();
}

// Called once from Python (ctypes) before any kernel runs: where MPI is, the
// handles that differ between MPI libraries, and the way back to Python.
// Returns nullptr, or what was not found (the library, or an MPI function).
namespace {
template <typename F>
bool Find(void* library, const char* name, F* function, const char** missing) {
  *function = reinterpret_cast<F>(dlsym(library, name));
  if (*function == nullptr && *missing == nullptr) *missing = name;
  return *function != nullptr;
}
}  // namespace

extern "C" const char* mpi_strategy_native_init(const char* mpi4py_library, intptr_t in_place,
                                                intptr_t byte, intptr_t int64, intptr_t max,
                                                Resolve callback) {
  void* library = dlopen(mpi4py_library, RTLD_NOLOAD | RTLD_LAZY);
  if (library == nullptr) return "the library";
  const char* missing = nullptr;
  Find(library, "MPI_Iallgather", &mpi.Iallgather, &missing);
  Find(library, "MPI_Wait", &mpi.Wait, &missing);
  Find(library, "MPI_Allreduce", &mpi.Allreduce, &missing);
  Find(library, "MPI_Bcast", &mpi.Bcast, &missing);
  Find(library, "MPI_Allgatherv", &mpi.Allgatherv, &missing);
  Find(library, "MPI_Iallreduce", &mpi.Iallreduce, &missing);
  Find(library, "MPI_Allgather", &mpi.Allgather, &missing);
  if (missing != nullptr) return missing;
  mpi.in_place = in_place;
  mpi.byte = byte;
  mpi.int64 = int64;
  mpi.max = max;
  resolve = callback;
  return nullptr;
}
