// A collective with a timeout, as core/timeouts.py does it: the agreement's
// exchange is polled until a deadline, and each rank tells the others the
// number of every timed collective it enters (one int64, point to point, on
// the announcements' own communicator, tag kAnnounceTag), so that a rank that
// gives up can name the ranks that never arrived. The announcements' state
// follows State in the communicator's block (timeouts.Announcements.shared),
// shared with the Python engine: the last collective each rank entered, then
// this side's outgoing number and pending send requests. On expiry Python writes the message
// (Agreement.timed_out), from that array.

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "common.h"

namespace mpi_strategy_kernels {
namespace {

struct Announcements {
  int64_t* last_seen;  // [size]
  int64_t* number;     // the buffer of the pending sends
  Handle* requests;    // [size], 0 for none
};

Announcements Shared(const Site& site) {
  int64_t* shared = site.held->words.data() + kStateFields;
  const Announced at = AnnouncedAt(site.state->size);  // (protocol.announced)
  return {shared + at.last_seen, shared + at.number,
          reinterpret_cast<Handle*>(shared + at.requests)};
}

// Reads the announcements that have arrived (Announcements.collect), source
// by source (which spares reading the source from an MPI_Status, whose
// layout differs between MPI libraries).
bool Collect(TF_OpKernelContext* ctx, const Site& site) {
  const State& state = *site.state;
  if (!site.timed || state.announce_comm == 0) return true;
  Announcements shared = Shared(site);
  alignas(16) unsigned char status[64];  // (larger than any MPI's MPI_Status)
  const Handle comm = static_cast<Handle>(state.announce_comm);
  for (int source = 0; source < state.size; ++source) {
    if (source == state.rank) continue;
    for (int arrived = 1; arrived;) {
      if (!MpiOk(ctx, site, mpi.Iprobe(source, kAnnounceTag, comm, &arrived, status))) {
        return false;
      }
      int64_t seq = 0;
      if (arrived &&
          !MpiOk(ctx, site, mpi.Recv(&seq, 1, mpi.int64, source, kAnnounceTag, comm, status))) {
        return false;
      }
      shared.last_seen[source] = std::max(shared.last_seen[source], seq);
    }
  }
  return true;
}

// The exchange's buffers, which MPI may still write into after a timeout:
// kept for as long as the process (the communicator is unusable after it).
void KeepPending(Site& site) {
  new std::vector<uint8_t>(std::move(site.received));
  new std::vector<int64_t>(std::move(site.extremes));
}

// Polls `request` until it completes (true) or the deadline passes (false,
// `expired`): often at first, then backing off to leave the cores to the
// ranks still computing (timeouts.wait).
bool Poll(TF_OpKernelContext* ctx, const Site& site, Handle* request, bool* expired) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(site.timeout);
  alignas(16) unsigned char status[64];
  double pause = 0.0;
  while (true) {
    int done = 0;
    if (!MpiOk(ctx, site, mpi.Test(request, &done, status))) return false;
    if (done) return true;
    if (Clock::now() > deadline) {
      *expired = true;
      return false;
    }
    if (pause > 0) {
      std::this_thread::sleep_for(std::chrono::duration<double>(pause));
    } else {
      std::this_thread::yield();
    }
    pause = std::min(2 * pause + 1e-5, 1e-3);
  }
}

}  // namespace

bool Announce(TF_OpKernelContext* ctx, const Site& site) {
  const State& state = *site.state;
  if (!site.timed || state.announce_comm == 0) return true;
  Announcements shared = Shared(site);
  alignas(16) unsigned char status[64];
  for (int r = 0; r < state.size; ++r) {  // (small: long since delivered)
    if (shared.requests[r] != 0 && !MpiOk(ctx, site, mpi.Wait(&shared.requests[r], status))) {
      return false;
    }
    shared.requests[r] = 0;
  }
  *shared.number = state.seq;
  for (int r = 0; r < state.size; ++r) {
    if (r != state.rank &&
        !MpiOk(ctx, site,
               mpi.Isend(shared.number, 1, mpi.int64, r, kAnnounceTag,
                         static_cast<Handle>(state.announce_comm), &shared.requests[r]))) {
      return false;
    }
  }
  shared.last_seen[state.rank] = state.seq;
  return true;
}

bool Complete(TF_OpKernelContext* ctx, Site& site, int rc, Handle* request) {
  if (!site.timed) {
    alignas(16) unsigned char status[64];
    if (rc == 0) rc = mpi.Wait(request, status);
    return MpiOk(ctx, site, rc);
  }
  bool expired = false;
  if (!MpiOk(ctx, site, rc) || !Poll(ctx, site, request, &expired)) {
    if (expired) {
      std::vector<uint8_t>* record = new std::vector<uint8_t>(std::move(site.record));
      KeepPending(site);
      double seconds = site.timeout;
      int64_t bits = 0;
      std::memcpy(&bits, &seconds, sizeof(bits));
      AskPython(ctx, site, kTimeout, bits, record->data());
    }
    return false;
  }
  return Collect(ctx, site);
}

}  // namespace mpi_strategy_kernels
