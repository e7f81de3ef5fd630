// Reads in flight without threads: Linux native AIO (io_setup / io_submit / io_getevents) over a file opened
// with O_DIRECT, for the expert cache's store (services/worker/expert_reads.py). Reads are queued with one
// syscall and land in their buffers while the caller computes; no helper thread wakes on its completion (on a
// 2-core machine a woken reader thread takes a core from the compute kernels, and Python's GIL handoffs cost
// more than the read). Completions are reaped by wait(), in whatever order they come. One thread uses an
// instance (the worker's step thread); its buffers must stay alive until their read is waited for.

#include "kernels.h"

#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace {

long io_setup(unsigned events, aio_context_t* ctx) { return syscall(SYS_io_setup, events, ctx); }
long io_destroy(aio_context_t ctx) { return syscall(SYS_io_destroy, ctx); }
long io_submit(aio_context_t ctx, long n, iocb** iocbs) { return syscall(SYS_io_submit, ctx, n, iocbs); }
long io_getevents(aio_context_t ctx, long min_nr, long max_nr, io_event* events) { return syscall(SYS_io_getevents, ctx, min_nr, max_nr, events, nullptr); }

constexpr long REAP_MOST = 64;  // events one io_getevents call takes

}  // namespace

struct DirectReads::Read {
  iocb cb;
  std::vector<iovec> buffers;
  bool done = false;
  int64_t result = 0;  // bytes read, or -errno
};

DirectReads::DirectReads(int64_t depth) : depth_(depth) {
  TORCH_CHECK(depth >= 1, "depth must be positive, got ", depth);
  if (io_setup(static_cast<unsigned>(depth), &ctx_) != 0) {
    throw std::system_error(errno, std::generic_category(), "io_setup");
  }
}

DirectReads::~DirectReads() {
  while (in_flight_ > 0 && reap(1)) {
  }  // no read may land in a buffer its owner has freed
  io_destroy(ctx_);
}

std::vector<int64_t> DirectReads::submit(int64_t fd, const std::vector<std::tuple<int64_t, std::vector<int64_t>>>& reads, int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "a read's buffers must have a positive size, got ", nbytes);
  std::vector<int64_t> tickets;
  std::vector<iocb*> queue;
  for (const auto& [offset, addresses] : reads) {
    TORCH_CHECK(!addresses.empty(), "a read needs buffers");
    auto read = std::make_unique<Read>();
    read->buffers.reserve(addresses.size());
    for (int64_t address : addresses) read->buffers.push_back({reinterpret_cast<void*>(address), static_cast<size_t>(nbytes)});
    const int64_t ticket = next_ticket_++;
    std::memset(&read->cb, 0, sizeof(read->cb));
    read->cb.aio_data = static_cast<uint64_t>(ticket);
    read->cb.aio_lio_opcode = IOCB_CMD_PREADV;
    read->cb.aio_fildes = static_cast<uint32_t>(fd);
    read->cb.aio_buf = reinterpret_cast<uint64_t>(read->buffers.data());
    read->cb.aio_nbytes = read->buffers.size();
    read->cb.aio_offset = offset;
    queue.push_back(&read->cb);
    reads_.emplace(ticket, std::move(read));
    tickets.push_back(ticket);
  }
  size_t queued = 0;  // one io_submit for as many as the queue takes: the storage is notified once for them all
  while (queued < queue.size()) {
    while (in_flight_ >= depth_) reap(1);
    const long got = io_submit(ctx_, std::min<long>(static_cast<long>(queue.size() - queued), depth_ - in_flight_), queue.data() + queued);
    if (got > 0) {
      queued += got;
      in_flight_ += got;
      continue;
    }
    if (got < 0 && errno == EINTR) continue;
    if ((got == 0 || errno == EAGAIN) && in_flight_ > 0) {  // the kernel's queue is full: make room
      reap(1);
      continue;
    }
    const int error = got == 0 ? EAGAIN : errno;
    for (size_t i = queued; i < queue.size(); ++i) {
      reads_.erase(tickets[i]);
      tickets[i] = -error;
    }
    break;
  }
  return tickets;
}

std::tuple<int64_t, bool> DirectReads::wait(int64_t ticket) {
  auto it = reads_.find(ticket);
  TORCH_CHECK(it != reads_.end(), "no read in flight has ticket ", ticket);
  const bool waited = !it->second->done && (reap(0), !it->second->done);
  while (!it->second->done) reap(1);
  const int64_t result = it->second->result;
  reads_.erase(it);
  return {result, waited};
}

bool DirectReads::reap(long at_least) {
  io_event events[REAP_MOST];
  const long got = io_getevents(ctx_, std::min(at_least, static_cast<long>(in_flight_)), REAP_MOST, events);
  if (got < 0) {
    TORCH_CHECK(errno == EINTR, "io_getevents: ", std::strerror(errno));
    return true;
  }
  for (long i = 0; i < got; ++i) {
    auto& read = reads_.at(static_cast<int64_t>(events[i].data));
    read->done = true;
    read->result = events[i].res;
    --in_flight_;
  }
  return got > 0 || at_least == 0;
}
