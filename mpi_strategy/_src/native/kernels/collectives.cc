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
// layout, event and op codes, the hash's constants, alignments, the ops'
// attributes, the callback's and init's signatures, the events' data layouts,
// the announcements' offsets) are not written here: they come from
// core/protocol.py, as the header the build generates, and
// mpi_strategy_protocol() reports them as compiled, which the loader compares
// with Python's before any kernel runs.
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
//
// This file: what every kernel shares (the link to MPI and to Python, the
// kernel's construction, tensors in and out, registering an op); the
// agreement is in agreement.cc, each collective in a file of its own.

#include <dlfcn.h>
#include <time.h>

#include <cstring>
#include <string>
#include <vector>

#include "common.h"

namespace mpi_strategy_kernels {

Mpi mpi;
Resolve resolve = nullptr;

void Release(Slot* slot) {
  if (slot->refs.fetch_sub(1) == 1) {
    std::free(slot->data);
    delete slot;
  }
}

void ReleaseOutput(void* /*data*/, size_t /*len*/, void* slot) { Release(static_cast<Slot*>(slot)); }

int64_t Attr(TF_OpKernelConstruction* ctx, const char* name, TF_Status* status) {
  int64_t value = 0;
  TF_OpKernelConstruction_GetAttrInt64(ctx, name, &value, status);
  return value;
}

void* Create(TF_OpKernelConstruction* ctx) {
  TF_Status* status = TF_NewStatus();
  auto* site = new Site;
  for (const AttrSpec& attr : kAttrs) site->*attr.field = Attr(ctx, AttrName(attr).c_str(), status);
  std::memcpy(&site->timeout, &site->timeout_bits, sizeof(double));
  if (TF_GetCode(status) != TF_OK) TF_OpKernelConstruction_Failure(ctx, status);
  TF_DeleteStatus(status);
  return site;
}

void Delete(void* site) { delete static_cast<Site*>(site); }

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
bool SetToken(TF_OpKernelContext* ctx, Site& site, TF_Status* status) {
  TF_Tensor* token = nullptr;
  TF_GetInput(ctx, 0, &token, status);
  if (Fail(ctx, status)) return false;
  TF_Tensor* next = TF_AllocateOutput(ctx, 0, TF_INT64, nullptr, 0, 8, status);
  if (!Fail(ctx, status)) {
    *static_cast<int64_t*>(TF_TensorData(next)) = *static_cast<int64_t*>(TF_TensorData(token)) + 1;
  }
  TF_DeleteTensor(token);
  TF_DeleteTensor(next);
  site.done = TF_GetCode(status) == TF_OK;
  return site.done;
}

double Now() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

int64_t InputBytes(TF_OpKernelContext* ctx) {
  TF_Status* status = TF_NewStatus();
  int64_t nbytes = 0;
  for (int i = 1; i < TF_NumInputs(ctx); ++i) {
    TF_Tensor* input = nullptr;
    TF_GetInput(ctx, i, &input, status);
    if (input != nullptr) nbytes += static_cast<int64_t>(TF_TensorByteSize(input));
    if (input != nullptr) TF_DeleteTensor(input);
  }
  TF_DeleteStatus(status);
  return nbytes;
}

// Python records the run (protocol.TRACE): the tensors as the Python engine
// counts them (small ones concatenated: one).
void Trace(TF_OpKernelContext* ctx, const Site& site, double started, int64_t nbytes) {
  TraceReport told{};
  told.started = started;
  told.agreed = site.agreed;
  told.ended = Now();
  told.bytes = nbytes;
  told.tensors = site.contiguous ? 1 : TF_NumInputs(ctx) - 1;
  told.seq = site.state->seq;
  AskPython(ctx, site, kTrace, site.trace, &told);
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

void UnknownShapes(TF_ShapeInferenceContext* ctx, TF_Status* status) {
  TF_ShapeInferenceContextSetUnknownShape(ctx, status);
}

// "a: T;b: int64" -> {"a: T", "b: int64"} (nullptr: none).
std::vector<std::string> Specs(const char* list) {
  std::vector<std::string> specs;
  if (list == nullptr) return specs;
  std::string rest = list;
  for (size_t end; (end = rest.find(';')) != std::string::npos; rest = rest.substr(end + 1)) {
    specs.push_back(rest.substr(0, end));
  }
  specs.push_back(rest);
  return specs;
}

// `types`: "T: type" (one dtype) plus "N: int" when `listed`, or "T: list(type)".
void RegisterOp(const char* name, const char* input, const char* output, bool listed,
                void (*compute)(void*, TF_OpKernelContext*), const char* types) {
  TF_Status* status = TF_NewStatus();
  TF_OpDefinitionBuilder* op = TF_NewOpDefinitionBuilder(name);
  TF_OpDefinitionBuilderAddInput(op, "token: int64");
  for (const std::string& spec : Specs(input)) TF_OpDefinitionBuilderAddInput(op, spec.c_str());
  TF_OpDefinitionBuilderAddOutput(op, "next_token: int64");
  for (const std::string& spec : Specs(output)) {
    TF_OpDefinitionBuilderAddOutput(op, spec.c_str());
  }
  if (types != nullptr) TF_OpDefinitionBuilderAddAttr(op, types);
  if (listed) TF_OpDefinitionBuilderAddAttr(op, "N: int >= 1");
  for (const AttrSpec& attr : kAttrs) TF_OpDefinitionBuilderAddAttr(op, attr.spec);
  TF_OpDefinitionBuilderSetIsStateful(op, true);
  TF_OpDefinitionBuilderSetShapeInferenceFunction(op, &UnknownShapes);
  TF_RegisterOpDefinition(op, status);
  TF_KernelBuilder* kernel = TF_NewKernelBuilder(name, "CPU", &Create, compute, &Delete);
  TF_RegisterKernelBuilder(name, kernel, status);
  TF_DeleteStatus(status);
}

}  // namespace mpi_strategy_kernels

using namespace mpi_strategy_kernels;  // NOLINT

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
  Find(library, "MPI_Alltoall", &mpi.Alltoall, &missing);
  Find(library, "MPI_Reduce_scatter", &mpi.Reduce_scatter, &missing);
  Find(library, "MPI_Alltoallv", &mpi.Alltoallv, &missing);
  Find(library, "MPI_Test", &mpi.Test, &missing);
  Find(library, "MPI_Isend", &mpi.Isend, &missing);
  Find(library, "MPI_Iprobe", &mpi.Iprobe, &missing);
  Find(library, "MPI_Recv", &mpi.Recv, &missing);
  if (missing != nullptr) return missing;
  mpi.in_place = in_place;
  mpi.byte = byte;
  mpi.int64 = int64;
  mpi.max = max;
  resolve = callback;
  return nullptr;
}
