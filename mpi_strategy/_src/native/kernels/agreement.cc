// The agreement before every collective, as core/agreement.py makes it:
// the record, its non-blocking Allgather (or, above HASHED_ABOVE ranks, an
// Allreduce of a hash), the preemption notice, and Python's answer when the
// ranks disagree or MPI fails.

#include <algorithm>
#include <cstring>
#include <string>

#include "common.h"

namespace mpi_strategy_kernels {

// Asks Python; false (and the error set on the context) unless it says go on.
bool AskPython(TF_OpKernelContext* ctx, const Site& site, Event event, int64_t value,
               const void* data) {
  std::string message(4096, '\0');
  if (data == nullptr) data = site.received.data();
  int code = resolve(site.engine, event, site.site, const_cast<void*>(data), value,
                     message.data(), static_cast<int64_t>(message.size()));
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
// (Agreement._heard).
void Heard(State& state, int64_t notice) {
  if (notice != 0 && state.noticed == 0) {
    state.noticed = notice;
    state.noticed_at = state.seq;
  }
}

// Above protocol.HASHED_ABOVE ranks: whether every rank's hash is this
// one's (one Allreduce, max, of (hash, -hash, notice)).
bool HashesAgree(TF_OpKernelContext* ctx, Site& site, const int64_t* signature, bool* agreed) {
  site.extremes = {HashOf(signature), -HashOf(signature), signature[kNotice]};
  int64_t* extremes = site.extremes.data();
  if (!Announce(ctx, site)) return false;
  Handle request = 0;
  int rc = mpi.Iallreduce(reinterpret_cast<void*>(mpi.in_place), extremes, 3, mpi.int64, mpi.max,
                          static_cast<Handle>(site.state->agree_comm), &request);
  if (!Complete(ctx, site, rc, &request)) return false;
  Heard(*site.state, extremes[2]);
  *agreed = extremes[0] == -extremes[1];
  return true;
}

namespace {
bool Agreed(TF_OpKernelContext* ctx, Site& site, int64_t token, const void* data,
            int64_t nbytes, bool* carried, int64_t rows);
}  // namespace

// The agreement (Agreement.agree_carrying): returns false on error (set on
// the context); `carried` is true when every rank's data is in the records.
bool Agree(TF_OpKernelContext* ctx, Site& site, int64_t token, const void* data,
           int64_t nbytes, bool* carried, int64_t rows) {
  if (!Agreed(ctx, site, token, data, nbytes, carried, rows)) return false;
  if (site.trace != 0) site.agreed = Now();  // (Agreement.agreed_at)
  return true;
}

namespace {
bool Agreed(TF_OpKernelContext* ctx, Site& site, int64_t token, const void* data,
            int64_t nbytes, bool* carried, int64_t rows) {
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
  if (!Announce(ctx, site)) return false;
  Handle request = 0;
  int rc = mpi.Iallgather(site.record.data(), static_cast<int>(record_bytes), mpi.byte,
                          site.received.data(), static_cast<int>(record_bytes), mpi.byte,
                          static_cast<Handle>(state.agree_comm), &request);
  if (!Complete(ctx, site, rc, &request)) return false;
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

}  // namespace

const uint8_t* CarriedData(const Site& site, int64_t rank) {
  return site.received.data() + rank * site.state->record_bytes + kSignatureBytes;
}

}  // namespace mpi_strategy_kernels
