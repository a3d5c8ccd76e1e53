// MpiStrategyAllreduce: sum, min, max or product of one or many tensors.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

namespace mpi_strategy_kernels {
namespace {

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
  SetToken(ctx, site, status);
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
        if (!Fail(ctx, status)) SetToken(ctx, site, status);
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
      SetToken(ctx, site, status);
    }
    if (out != nullptr) TF_DeleteTensor(out);
  } else if (TF_GetCode(status) == TF_OK) {
    AllreducePacked(ctx, site, token, n, status);
  }
  TF_DeleteStatus(status);
}

struct Registration {
  Registration() {
    RegisterOp("MpiStrategyAllreduce", "inputs: N * T", "outputs: N * T", true,
               &Run<&AllreduceCompute>);
  }
} registration;

}  // namespace
}  // namespace mpi_strategy_kernels
