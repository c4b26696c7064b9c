#pragma once
// cohort/comm/gloo.hpp's definitions: header-only, cold templates (COHORT_COLD) but for what the
// engine's destructor runs, so that a unit that makes no group instantiates none of the
// connection, the worker and the collectives over Gloo's templates; compiled once by
// <cohort/src.hpp> under COHORT_SEPARATE_COMPILATION (see cohort/config.hpp).

#include <dirent.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/context.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <vector>
#include "cohort/comm/detail/failure_report.hpp"
#include "cohort/comm/detail/fifo_worker.hpp"
#include "cohort/comm/detail/host_address.hpp"
#include "cohort/comm/detail/host_elementwise.hpp"
#include "cohort/comm/detail/shared_memory_channel.hpp"
#include "cohort/detail/files.hpp"
#include "cohort/detail/fnv1a.hpp"
#include "cohort/detail/host_math.hpp"
#include "cohort/detail/progress.hpp"
#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"
#include "cohort/rendezvous/detail/job_identity.hpp"
#include "cohort/rendezvous/launch.hpp"
#include "cohort/rendezvous/store.hpp"
#include "cohort/types.hpp"

#include "cohort/comm/gloo.hpp"
#include "cohort/config.hpp"

namespace cohort::inline v0 {

namespace detail {

// A Gloo context over the pairs cohort connected itself (gloo::connect): Gloo's own
// full-mesh rendezvous reads every peer's key one request at a time and waits inside each
// pair's connect for up to five times the timeout, unbounded by anything cohort can set.
class gloo_mesh_context final : public ::gloo::Context {
 public:
  gloo_mesh_context(int rank, int size, std::shared_ptr<::gloo::transport::Device> device,
                    std::shared_ptr<::gloo::transport::Context> transport)
      : ::gloo::Context(rank, size) {
    device_ = std::move(device);
    transportContext_ = std::move(transport);
  }
};

// What a rank publishes at the rendezvous, under "gloo/<rank>": a text header (format tag,
// host name, process id, its process table, listen address, where its shared-memory segment
// is or "tcp"), then the bytes of its pairs' addresses, one per other rank in rank order. (A
// subgroup's world ranks come from the split, known before anyone publishes.)
inline constexpr std::string_view gloo_peer_format = "cohort-gloo-4";

COHORT_COLD inline std::string this_host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "?";
  return name;
}

// Where a pid names a process: this kernel's boot and this pid namespace ("<boot id>/<ns
// device>:<ns inode>"). Host names repeat (cloned images), and two machines' pids, or two
// pid namespaces', name different processes. Empty where it cannot be read: then no peer's
// pid is looked up here.
COHORT_COLD inline std::string process_table_id() {
  std::string boot = read_small_file("/proc/sys/kernel/random/boot_id");
  boot.resize(std::min(boot.size(), boot.find_first_of(" \n")));
  struct ::stat namespace_file {};
  if (boot.empty() || ::stat("/proc/self/ns/pid", &namespace_file) != 0) return {};
  return detail::text(boot, "/", std::to_string(namespace_file.st_dev), ":", std::to_string(namespace_file.st_ino));
}

// What this host's process table says of `pid` (one of its own).
enum class process_seen : std::uint8_t { unknown, running, stopped, gone };
COHORT_COLD inline process_seen look_up_process(long pid) {
  if (pid <= 0) return process_seen::unknown;
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH ? process_seen::gone : process_seen::running;
  // Its state, from /proc where /proc shows this pid namespace (its /proc/self is this pid):
  // a zombie has exited, a stopped process keeps its sockets open but answers nothing.
  char self[32] = {};
  const ssize_t length = ::readlink("/proc/self", self, sizeof self - 1);
  if (length <= 0 || std::string_view(self, static_cast<std::size_t>(length)) != std::to_string(::getpid()))
    return process_seen::running;
  const std::string stat = read_small_file(detail::text("/proc/", std::to_string(pid), "/stat"));
  const auto name_ends = stat.rfind(')');  // the command name may hold anything, ')' included
  if (name_ends == std::string::npos || name_ends + 2 >= stat.size()) return process_seen::running;
  switch (stat[name_ends + 2]) {
    case 'Z':
    case 'X': return process_seen::gone;
    case 'T':
    case 't': return process_seen::stopped;
    default: return process_seen::running;
  }
}

COHORT_COLD inline bytes encode_gloo_peer(const gloo_peer& mine) {
  const std::string header =
      detail::text(gloo_peer_format, "\n", mine.host, "\n", std::to_string(mine.pid), "\n", mine.process_table, "\n",
                   mine.address, "\n", (mine.shared_memory.empty() ? std::string("tcp") : mine.shared_memory), "\n");
  bytes value(header.begin(), header.end());
  value.insert(value.end(), mine.pairs.begin(), mine.pairs.end());
  return value;
}

// False when `value` is not what encode_gloo_peer writes for a world of `size`.
COHORT_COLD inline bool decode_gloo_peer(const bytes& value, int size, gloo_peer& out) {
  std::size_t at = 0;
  std::string fields[6];
  for (auto& field : fields) {
    const auto end = std::find(value.begin() + static_cast<std::ptrdiff_t>(at), value.end(), '\n');
    if (end == value.end()) return false;
    field.assign(value.begin() + static_cast<std::ptrdiff_t>(at), end);
    at = static_cast<std::size_t>(end - value.begin()) + 1;
  }
  if (fields[0] != gloo_peer_format) return false;
  int pid = 0;
  if (!parse_int_fields(fields[2], ',', std::span<int>(&pid, 1))) return false;
  const std::size_t rest = value.size() - at;
  if (size < 2 || rest == 0 || rest % static_cast<std::size_t>(size - 1) != 0) return false;
  out.host = fields[1];
  out.pid = pid;
  out.process_table = fields[3];
  out.address = fields[4];
  out.shared_memory = fields[5] == "tcp" ? std::string() : fields[5];
  out.pairs.assign(value.begin() + static_cast<std::ptrdiff_t>(at), value.end());
  return true;
}

// Gloo's TCP transport writes with writev, which raises SIGPIPE once a peer has died, and the
// signal's default action kills this rank before cohort can name the dead one (PyTorch never
// meets this: Python ignores SIGPIPE). So whatever writes to Gloo's sockets runs with SIGPIPE
// blocked: the device's event loop and cohort's workers, which inherit the mask of the thread
// that starts them inside this scope and keep it; the caller during the rendezvous; and the
// caller while it runs a queued call itself (gloo::run). The write then fails with EPIPE,
// Gloo reports it, and the trainer's threads and the process's disposition stay as they were.
// On a thread that already blocks SIGPIPE this is one system call.
class sigpipe_blocked {
 public:
  sigpipe_blocked() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_, &previous_);
  }
  sigpipe_blocked(const sigpipe_blocked&) = delete;
  sigpipe_blocked& operator=(const sigpipe_blocked&) = delete;
  ~sigpipe_blocked() {
    if (sigismember(&previous_, SIGPIPE)) return;  // the caller had it blocked already
    // A SIGPIPE raised meanwhile waits on this thread: take it before unblocking.
    sigset_t pending;
    if (sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE)) {
      const timespec now{0, 0};
      (void)sigtimedwait(&pipe_, nullptr, &now);
    }
    pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
  }

 private:
  sigset_t pipe_;
  sigset_t previous_;
};

// Whether the host of a Gloo address (its bytes) answers a TCP connection attempt within
// `bound`: accepted or refused, it is reachable; no answer, or no route, it is not (`why`).
COHORT_COLD inline bool host_answers(const std::vector<char>& pair_address, std::chrono::milliseconds bound,
                                     std::string& why) {
  const ::gloo::transport::tcp::Address address(pair_address);
  const sockaddr_storage& target = address.getSockaddr();
  const socklen_t length = target.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  const int fd = ::socket(target.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;  // cannot tell: do not call it unreachable
  int result = ::connect(fd, reinterpret_cast<const sockaddr*>(&target), length) == 0 ? 0 : errno;
  if (result == EINPROGRESS) {
    pollfd wait{fd, POLLOUT, 0};
    if (::poll(&wait, 1, static_cast<int>(bound.count())) == 1) {
      socklen_t size = sizeof result;
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &result, &size);
    } else {
      result = ETIMEDOUT;
    }
  }
  ::close(fd);
  if (result == 0 || result == ECONNREFUSED) return true;
  std::string host = address.str();  // "[10.0.0.3]:40123": the host is what did not answer
  if (host.size() > 2 && host.front() == '[') host = host.substr(1, host.find(']') - 1);
  why = detail::text("no answer from ", host,
                     (result == ETIMEDOUT ? detail::text(" within ", format_duration(bound))
                                          : detail::text(": ", std::system_category().message(result))));
  return false;
}

// Shuts down (both ways) every socket of this process bound to one of `ends`: Gloo's event
// loop then sees each connection close and fails every call waiting on it, here, and the
// peer sees it close too. Found through /proc/self/fd, each socket by its local address and
// port, which no two of a process's connections share.
COHORT_COLD inline void shut_down_sockets_at(const std::vector<sockaddr_storage>& ends) {
  if (ends.empty()) return;
  DIR* directory = ::opendir("/proc/self/fd");
  if (directory == nullptr) return;
  const auto same = [](const sockaddr_storage& a, const sockaddr_storage& b) {
    if (a.ss_family != b.ss_family) return false;
    if (a.ss_family == AF_INET) {
      const auto& x = reinterpret_cast<const sockaddr_in&>(a);
      const auto& y = reinterpret_cast<const sockaddr_in&>(b);
      return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr;
    }
    if (a.ss_family == AF_INET6) {
      const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
      const auto& y = reinterpret_cast<const sockaddr_in6&>(b);
      return x.sin6_port == y.sin6_port && std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof x.sin6_addr) == 0;
    }
    return false;
  };
  while (const dirent* entry = ::readdir(directory)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == ::dirfd(directory)) continue;
    sockaddr_storage local{};
    socklen_t length = sizeof local;
    if (::getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &length) != 0) continue;
    for (const auto& wanted : ends)
      if (same(local, wanted)) {
        ::shutdown(static_cast<int>(fd), SHUT_RDWR);
        break;
      }
  }
  ::closedir(directory);
}

COHORT_DECL gloo_p2p::gloo_p2p() = default;
COHORT_DECL gloo_p2p::~gloo_p2p() = default;

COHORT_DECL void gloo_p2p::abort() {
  std::lock_guard lock(mutex);
  if (!buffer) return;
  if (sending)
    buffer->abortWaitSend();
  else
    buffer->abortWaitRecv();
}

}  // namespace detail

COHORT_COLD_BODY gloo::gloo(std::shared_ptr<cohort::store> store, const launch_env& env, const options& opts)
    : rank_(env.rank),
      size_(env.world_size),
      world_rank_(env.rank),
      names_{detail::group_name(*store), {}},
      options_(opts) {
  device_ = make_device(env, opts, *store, address_);
  connect(std::move(store));
}

COHORT_COLD_BODY gloo::gloo(const gloo& parent, std::shared_ptr<cohort::store> store, int rank,
                            std::vector<int> world_ranks)
    : rank_(rank),
      size_(static_cast<int>(world_ranks.size())),
      world_rank_(parent.world_rank_),
      names_{detail::group_name(*store), std::move(world_ranks)},
      options_(parent.options_),
      address_(parent.address_),
      device_(parent.device_) {
  connect(std::move(store));
}

COHORT_DECL gloo::~gloo() {
  // Queued work runs first (its buffers are the caller's); the watchdog still watches it, so
  // a drain that waits for ranks in another call ends as any call does.
  if (worker_) worker_->shutdown();
  // Said before the connections close: a rank still waiting for this one reads that it left,
  // and how many collectives it issued, instead of only seeing its connection close.
  if (board_) {
    auto left = status(detail::rank_activity::left);
    left.call = detail::newest_collective(recorder_);
    left.note = std::uncaught_exceptions() > 0 ? "its process group was destroyed while an exception unwound its stack"
                                               : "its process group was destroyed";
    board_->try_publish_on_group_store(left);
  }
  watchdog_.reset();  // the group is going away: what is left to fail is the destructor's
  // Point-to-point operations still unmatched would keep the completion worker waiting
  // for up to the timeout: end them, the group is going away.
  {
    std::lock_guard lock(p2p_mutex_);
    for (auto& weak : live_p2p_)
      if (auto pending = weak.lock()) pending->abort();
  }
  if (p2p_worker_) p2p_worker_->shutdown();
}

COHORT_COLD_BODY auto gloo::split(gloo& parent, std::shared_ptr<cohort::store> sub_store, int color, int /*key*/,
                                  int new_rank, const std::vector<int>& members) -> std::unique_ptr<gloo> {
  if (color < 0) return nullptr;
  // Known before the rendezvous, so that even its errors name the members by world rank.
  std::vector<int> world_ranks;
  for (const int parent_rank : members) world_ranks.push_back(parent.names_.world_rank(parent_rank));
  return std::make_unique<gloo>(parent, std::move(sub_store), new_rank, std::move(world_ranks));
}

// The work handle's waits live here, with the worker they wait on: a unit that includes
// the header does not instantiate the worker's queue and waits (compiled once, see config.hpp).
COHORT_COLD_BODY bool gloo::work::test() const {
  if (!worker_) return true;
  if (!worker_->done(seq_)) return false;
  rethrow_failure();
  return true;
}

COHORT_COLD_BODY void gloo::work::wait() const {
  if (!worker_) return;
  worker_->wait_until_done(seq_, std::chrono::steady_clock::time_point::max());
  rethrow_failure();
}

COHORT_COLD_BODY bool gloo::work::wait_for(std::chrono::milliseconds timeout) const {
  if (!worker_) return true;
  if (!worker_->wait_until_done(seq_, std::chrono::steady_clock::now() + timeout)) return false;
  rethrow_failure();
  return true;
}

COHORT_COLD_BODY void gloo::work::rethrow_failure() const {
  if (auto failure = worker_->failure(seq_)) std::rethrow_exception(failure);
}

COHORT_COLD_BODY auto gloo::enqueue(std::function<void()> fn) -> work {
  auto queued = task(task_kind::function);
  queued.fn = std::move(fn);
  return submit(std::move(queued));
}

COHORT_COLD_BODY auto gloo::copy(void* destination, const void* source, std::size_t bytes) -> work {
  // Still queued when empty: the returned work orders after everything before it.
  return enqueue([=] {
    if (bytes != 0) std::memmove(destination, source, bytes);  // null is allowed when empty
  });
}

COHORT_COLD_BODY auto gloo::make_device(const launch_env& env, const options& opts, cohort::store& rendezvous,
                                        std::string& address) -> std::shared_ptr<::gloo::transport::Device> {
  detail::listen_request request;
  request.rank = env.rank;
  request.hostname = opts.hostname;
  request.interface = opts.interface;
  if (const char* name = std::getenv("GLOO_SOCKET_IFNAME")) request.env_interface = name;
  request.master_addr = env.master_addr;
  request.world_size = env.world_size;
  request.local_world_size = env.local_world_size;
  request.reached_by_other_nodes = [&] { return rendezvous.reached_from_other_hosts(opts.timeout); };
  const detail::listen_choice choice = detail::choose_listen_address(request);
  if (detail::debug_from_environment())
    std::fprintf(stderr, "cohort [rank %d] gloo: listening on %s (%s)\n", env.rank, choice.address.c_str(),
                 choice.reason.c_str());
  address = choice.address;
  // Gloo gets a numeric address only: its own lookup of a name is unchecked (a name that
  // does not resolve crashes it), and the choice above is what the errors name.
  ::gloo::transport::tcp::attr attr;
  attr.hostname = choice.address;
  try {
    const detail::sigpipe_blocked loop_thread_inherits_it;
    return ::gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& failure) {
    throw error(
        env.rank, "gloo.create_device",
        detail::text("cannot open a TCP device on ", choice.address, " (", choice.reason, "): ", failure.what()),
        "set options.hostname or GLOO_SOCKET_IFNAME to an address of this host");
  }
}

COHORT_COLD_BODY auto gloo::connect(std::shared_ptr<cohort::store> store) -> void {
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  store_ = std::move(store);
  const detail::sigpipe_blocked writes_fail_with_epipe;  // also for the threads started below
  // Every pair listens from its creation, so its address can be published before any peer
  // connects: one key per rank, read with one multi_get (O(1) requests per rank).
  std::shared_ptr<::gloo::transport::Context> transport = device_->createContext(rank_, size_);
  transport->setTimeout(options_.timeout);
  detail::gloo_peer mine;
  mine.host = detail::this_host_name();
  mine.pid = static_cast<long>(::getpid());
  mine.process_table = detail::process_table_id();
  mine.address = address_;
  const char* shared_memory_env = std::getenv("COHORT_GLOO_SHARED_MEMORY");
  // Made before the rendezvous, so that where it is travels with the addresses.
  if (size_ > 1 && options_.shared_memory &&
      !(shared_memory_env != nullptr && std::string_view(shared_memory_env) == "0"))
    shared_memory_ = detail::shared_memory_channel::create(rank_, size_);
  if (shared_memory_) mine.shared_memory = shared_memory_->published();
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    std::vector<char> pair;
    try {
      pair = transport->createPair(peer)->address().bytes();
    } catch (const std::exception& failure) {
      // Gloo's bare "socket: Too many open files": this rank never publishes, and the others
      // name it as never arrived; its own error says why.
      throw error(world_rank_, "gloo.rendezvous",
                  detail::text(names_.lead(), "cannot open this rank's end of its connection with ", names_(peer),
                               " on ", address_, ": ", failure.what()),
                  "every group needs a socket per peer on every rank: raise the open-files limit (ulimit -n) "
                  "or close descriptors the trainer no longer needs");
    }
    mine.pairs.insert(mine.pairs.end(), pair.begin(), pair.end());
  }
  std::vector<std::string> keys;
  for (int peer = 0; peer < size_; ++peer) keys.push_back(detail::text("gloo/", std::to_string(peer)));
  // Within the group's timeout, like the multi_get after it (a store gone silent ends both).
  store_->set_within(keys[static_cast<std::size_t>(rank_)],
                     std::span<const std::uint8_t>(detail::encode_gloo_peer(mine)), options_.timeout);
  std::vector<bytes> published;
  // In slices of the progress interval, each ended by a line saying what it waits for.
  detail::progress_clock lines(options_.progress_interval);
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    const auto slice =
        std::max(std::chrono::duration_cast<std::chrono::milliseconds>(std::min(deadline, lines.next()) - now),
                 std::chrono::milliseconds(1));
    try {
      published = store_->multi_get(std::span<const std::string>(keys), slice);
      break;
    } catch (const timeout_error& failure) {
      if (std::chrono::steady_clock::now() >= deadline)
        throw timeout_error(world_rank_, "gloo.rendezvous",
                            detail::text(names_.lead(), missing_at_rendezvous(*store_), rendezvous_context(),
                                         " within ", detail::format_duration(options_.timeout)),
                            "a rank never arrived: is every rank started with the same WORLD_SIZE "
                            "and MASTER_ADDR/MASTER_PORT?");
      if (lines.due())
        detail::progress_line(
            world_rank_,
            detail::text(detail::group_name(*store_), " rendezvous: waiting ", detail::format_seconds(lines.elapsed()),
                         " of its ", detail::format_duration(options_.timeout), " timeout: ",
                         (rank_ == 0 ? missing_at_rendezvous(*store_)
                                     : detail::text("not every one of the ", std::to_string(size_),
                                                    " ranks has published its address (", names_(0), " names them)"))));
    }
  }
  peers_.assign(static_cast<std::size_t>(size_), {});
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) {
      peers_[static_cast<std::size_t>(peer)] = mine;
      continue;
    }
    const auto& value = published[static_cast<std::size_t>(peer)];
    if (!detail::decode_gloo_peer(value, size_, peers_[static_cast<std::size_t>(peer)]) ||
        peers_[static_cast<std::size_t>(peer)].pairs.size() != mine.pairs.size())
      throw detail::malformed_store_value(world_rank_, "gloo.rendezvous", keys[static_cast<std::size_t>(peer)], value,
                                          "a Gloo rank's addresses, as cohort of this version writes them");
  }
  connect_mesh(*transport, deadline);
  auto context = std::make_shared<detail::gloo_mesh_context>(rank_, size_, device_, std::move(transport));
  context->setTimeout(options_.timeout);
  context_ = std::move(context);
  agree_on_shared_memory(mine);
  worker_ = std::make_shared<worker_type>([this](detail::gloo_task& task) { run(task); });
  p2p_worker_ = std::make_shared<worker_type>([this](detail::gloo_task& task) { run(task); });
  board_ = std::make_unique<detail::status_board>(store_, rank_, size_, options_.timeout, names_);
  board_->try_publish_on_group_store(status(detail::rank_activity::joined));
  start_watchdog();
}

COHORT_COLD_BODY auto gloo::agree_on_shared_memory(const detail::gloo_peer& mine) -> void {
  // Tried where every rank is on this host (its name, and its process table: cloned machines
  // share names) and made a segment: every rank reads the same published records, so all try
  // or none does.
  const bool every_rank_here = std::all_of(peers_.begin(), peers_.end(), [&](const detail::gloo_peer& peer) {
    return peer.host == mine.host && !mine.process_table.empty() && peer.process_table == mine.process_table &&
           !peer.shared_memory.empty();
  });
  if (!every_rank_here) {
    shared_memory_.reset();
    return;
  }
  std::vector<std::string> published;
  std::vector<detail::shared_memory_channel::peer_process> processes;
  for (const auto& peer : peers_) {
    published.push_back(peer.shared_memory);
    processes.push_back({peer.pid});
  }
  // Whether all of them mapped every segment, agreed over the mesh just connected (no store
  // request): the minimum of everyone's answer, on a tag no call of the group uses.
  std::int32_t mapped = shared_memory_->map_peers(published, processes) ? 1 : 0;
  try {
    ::gloo::AllreduceOptions opts(context_);
    opts.setTag(0x7fffffffu);
    opts.setOutput(&mapped, 1);
    opts.setReduceFunction(detail::reduce_function(dtype::int32, op::min));
    opts.setTimeout(options_.timeout);
    ::gloo::allreduce(opts);
  } catch (const std::exception& failure) {
    throw error(world_rank_, "gloo.rendezvous",
                detail::text("the ranks could not agree on shared memory: ", failure.what()),
                "a rank died or stopped during the rendezvous");
  }
  if (mapped == 1)
    shared_memory_->release_descriptor();  // every peer has mapped it
  else
    shared_memory_.reset();
}

COHORT_COLD_BODY auto gloo::peer_pair_address(int peer) const -> std::vector<char> {
  // Rank p's list skips p itself: this rank's entry is at index rank_ - (rank_ > p).
  const auto& theirs = peers_[static_cast<std::size_t>(peer)];
  const std::size_t width = theirs.pairs.size() / static_cast<std::size_t>(size_ - 1);
  const std::size_t index = static_cast<std::size_t>(rank_ > peer ? rank_ - 1 : rank_);
  return std::vector<char>(theirs.pairs.begin() + static_cast<std::ptrdiff_t>(index * width),
                           theirs.pairs.begin() + static_cast<std::ptrdiff_t>((index + 1) * width));
}

COHORT_COLD_BODY auto gloo::describe_peer(int peer) const -> std::string {
  const auto& theirs = peers_[static_cast<std::size_t>(peer)];
  std::string pair = "?";
  try {
    pair = ::gloo::transport::tcp::Address(peer_pair_address(peer)).str();
  } catch (const std::exception&) {}
  return detail::text(names_(peer), " published ", theirs.address, " (host ", theirs.host, ", pid ",
                      std::to_string(theirs.pid), ", its pair for this rank at ", pair, ")");
}

COHORT_COLD_BODY auto gloo::connect_mesh(::gloo::transport::Context& transport,
                                         std::chrono::steady_clock::time_point deadline) -> void {
  // Gloo's pair connect has no retry and waits for its peer (on the side that accepts) for
  // five times the timeout, and nothing cohort can set bounds it. An alarm closes every pair
  // at the deadline: a closed pair ends the wait, and the loop below turns that into an error
  // naming the peer and both addresses, within the group's timeout on every rank.
  int local_rank = 0;
  for (int peer = 0; peer < rank_; ++peer)
    if (peers_[static_cast<std::size_t>(peer)].host == peers_[static_cast<std::size_t>(rank_)].host) ++local_rank;
  std::mutex mutex;
  std::condition_variable finished;
  bool done = false;
  std::atomic<bool> expired{false};
  std::thread alarm([&] {
    std::unique_lock lock(mutex);
    if (finished.wait_until(lock, deadline, [&] { return done; })) return;
    expired = true;
    for (int peer = 0; peer < size_; ++peer)
      if (peer != rank_) transport.getPair(peer)->close();
  });
  const auto stop_alarm = [&] {
    {
      std::lock_guard lock(mutex);
      done = true;
    }
    finished.notify_all();
    alarm.join();
  };
  const std::string world = rendezvous_context();
  const auto timed_out = [&](int peer) {
    return timeout_error(world_rank_, "gloo.rendezvous",
                         detail::text(names_.lead(), "no connection with ", names_(peer), " within ",
                                      detail::format_duration(options_.timeout), world, ": ", describe_peer(peer)),
                         "the published addresses must be reachable between the nodes: check that no firewall "
                         "blocks them, or name the interface the nodes share (GLOO_SOCKET_IFNAME)");
  };
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    auto& pair = transport.getPair(peer);
    pair->setLocalRank(local_rank);
    try {
      pair->connect(peer_pair_address(peer));
    } catch (const std::exception& failure) {
      const bool late = expired.load();
      stop_alarm();
      if (late) throw timed_out(peer);
      throw error(
          world_rank_, "gloo.rendezvous",
          detail::text(names_.lead(), "cannot connect to ", names_(peer), world, ": ", describe_peer(peer), ": ",
                       failure.what()),
          detail::text(names_(peer),
                       "'s address is not reachable from this host: a loopback address (127.x) across nodes, or "
                       "a firewall; name the interface the nodes share (GLOO_SOCKET_IFNAME) or leave it unset to "
                       "have cohort choose"));
    }
    if (expired.load()) {
      stop_alarm();
      throw timed_out(peer);
    }
  }
  stop_alarm();
  if (expired.load()) throw timed_out(rank_ == 0 ? 1 : 0);
}

COHORT_COLD_BODY auto gloo::start_watchdog() -> void {
  if (options_.watchdog_interval.count() <= 0) return;
  const std::string group = detail::group_name(*store_);
  // process_group makes a job's first group under cohort/pg1/ of the job's store.
  if (options_.collision_check_interval.count() > 0 && names_.is_world())
    if (const auto* first = dynamic_cast<const prefix_store*>(store_.get());
        first && first->prefix() == "cohort/pg1/") {
      job_store_ = first->inner();
      next_job_check_ = std::chrono::steady_clock::now() + options_.collision_check_interval;
    }
  if (options_.compare_calls_after.count() > 0 || options_.progress_interval.count() > 0)
    monitor_ = std::make_unique<detail::progress_monitor>(
        *board_, group, detail::progress_monitor::settings{options_.compare_calls_after, options_.progress_interval});
  watchdog_ = std::make_unique<detail::watchdog>(world_rank_, group, options_.on_async_error,
                                                 options_.watchdog_interval, [this] { return watch(); });
}

COHORT_COLD_BODY auto gloo::watch() -> std::exception_ptr {
  if (auto collided = job_collision()) return collided;
  if (monitor_) {
    std::optional<detail::pending_call> pending;
    {
      std::lock_guard lock(running_mutex_);  // run() clears running_ under it before the task goes
      if (running_) pending = detail::pending_call{as_call(*running_), running_since_};
    }
    std::string verdict = monitor_->tick(pending, status(detail::rank_activity::in_call));
    if (!verdict.empty()) {
      {
        std::lock_guard lock(verdict_mutex_);
        if (!verdict_.empty()) return unreported_failure();  // ended already
        verdict_ = verdict;
      }
      // Said first, then the call ended: the other ranks read why this one stopped.
      auto failed = status(detail::rank_activity::failed);
      failed.call = pending->call;
      failed.note = std::move(verdict);
      board_->try_publish(failed);
      abort_transport();
    }
  }
  return unreported_failure();
}

COHORT_COLD_BODY auto gloo::job_collision() -> std::exception_ptr {
  if (!job_store_ || std::chrono::steady_clock::now() < next_job_check_) return nullptr;
  next_job_check_ = std::chrono::steady_clock::now() + options_.collision_check_interval;
  std::optional<error> collided;
  try {
    // Not the trainer's handle, which a long WAIT of its own may hold.
    if (!job_handle_) job_handle_ = job_store_->bounded(detail::report_window(options_.timeout));
    store& job = job_handle_ ? *job_handle_ : *job_store_;
    if (!detail::job_marked_collided(job)) return nullptr;
    collided = detail::job_collision_error(job, world_rank_, "gloo.watchdog",
                                           detail::text("the job's first group (", detail::group_name(*store_),
                                                        ") stops on every rank: it has computed with another job's"));
  } catch (const std::exception&) {
    return nullptr;  // a store out of reach is for the group's calls and run_ranks to report
  }
  {
    std::lock_guard lock(verdict_mutex_);
    collision_ = std::make_exception_ptr(*collided);
  }
  // Said first, then the call ended: the other ranks read why this one stopped.
  auto failed = status(detail::rank_activity::failed);
  failed.note = collided->detail();
  board_->try_publish(failed);
  abort_transport();
  return std::make_exception_ptr(*collided);
}

COHORT_DECL auto gloo::status(detail::rank_activity activity) const -> detail::rank_status {
  detail::rank_status now;
  now.activity = activity;
  now.issued = collectives_issued_.load(std::memory_order_relaxed);
  now.completed = collectives_completed_.load(std::memory_order_relaxed);
  for (std::size_t k = 0; k < call_kinds; ++k) now.by_kind[k] = issued_by_kind_[k].load(std::memory_order_relaxed);
  return now;
}

COHORT_COLD_BODY auto gloo::abort_transport() noexcept -> void {
  if (shared_memory_) shared_memory_->shut_down();
  if (!context_) return;
  try {
    std::vector<sockaddr_storage> ends;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      const auto& pair = context_->getPair(peer);
      if (pair) ends.push_back(::gloo::transport::tcp::Address(pair->address().bytes()).getSockaddr());
    }
    detail::shut_down_sockets_at(ends);
  } catch (...) {}
}

COHORT_COLD_BODY auto gloo::unreported_failure() const -> std::exception_ptr {
  if (auto failure = worker_->unreported_failure(options_.timeout)) return failure;
  return p2p_worker_->unreported_failure(options_.timeout);
}

COHORT_COLD_BODY auto gloo::write_trace(const std::string& directory, std::string_view reason) const -> std::string {
  return detail::write_trace(directory, {detail::group_name(*store_), name, rank_, size_}, recorder_, reason);
}

COHORT_COLD_BODY auto gloo::keep_trace(const std::exception_ptr& failure) -> void {
  const std::string directory = detail::trace_directory(options_.trace_dir);
  if (directory.empty() || trace_written_.exchange(true)) return;
  std::string reason = "unknown failure";
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& known) {
    reason = known.what();
  } catch (...) {}
  write_trace(directory, reason);
}

COHORT_COLD_BODY auto gloo::task(task_kind what, dtype type, op reduce, const void* in, void* out, std::size_t count,
                                 int peer, std::uint64_t tag) -> detail::gloo_task {
  detail::gloo_task queued;
  queued.what = what;
  queued.type = type;
  queued.reduce = reduce;
  queued.in = in;
  queued.out = out;
  queued.count = count;
  queued.peer = peer;
  queued.tag = tag;
  return queued;
}

COHORT_COLD_BODY auto gloo::submit(detail::gloo_task queued) -> work {
  if (watchdog_) watchdog_->rethrow_if_failed();
  if (queued.what != task_kind::function) {
    queued.context = call_context_;
    queued.sequence = collectives_issued_.fetch_add(1) + 1;
    const call_record call = as_call(queued);
    issued_by_kind_[static_cast<std::size_t>(call.kind)].fetch_add(1, std::memory_order_relaxed);
    queued.record = recorder_.issued(call);
  }
  const std::uint64_t seq = worker_->submit(std::move(queued));
  return work(worker_, seq);
}

COHORT_COLD_BODY auto gloo::post(detail::gloo_task operation) -> work {
  if (watchdog_) watchdog_->rethrow_if_failed();
  auto pending = std::make_shared<detail::gloo_p2p>();
  {
    std::lock_guard lock(p2p_mutex_);
    std::erase_if(live_p2p_, [](const std::weak_ptr<detail::gloo_p2p>& weak) { return weak.expired(); });
    live_p2p_.push_back(pending);
    // A send to B with tag t is matched by B's recv from this rank with tag t, in order.
    operation.sequence = ++p2p_issued_[{operation.peer, operation.tag, operation.what == task_kind::send}];
  }
  operation.context = call_context_;
  operation.record = recorder_.issued(as_call(operation));
  if (debug_checks_.load(std::memory_order_relaxed))
    store_->set(p2p_debug_key(operation, true),
                detail::text(to_string(operation.type), " x ", std::to_string(operation.count)));
  auto completion = task(task_kind::p2p_wait, operation.type, op::sum, operation.in, operation.out, operation.count,
                         operation.peer, operation.tag);
  completion.sequence = operation.sequence;
  completion.record = operation.record;
  completion.context = operation.context;
  completion.p2p = pending;
  operation.p2p = pending;
  pending->sending = operation.what == task_kind::send;
  pending->debug = debug_checks_.load(std::memory_order_relaxed);
  pending->post_sequence = worker_->submit(std::move(operation));
  return work(p2p_worker_, p2p_worker_->submit(std::move(completion)));
}

COHORT_COLD_BODY auto gloo::as_call(const detail::gloo_task& task) -> call_record {
  using enum call_kind;
  call_record call;
  switch (task.what) {
    case task_kind::all_reduce: call.kind = call_kind::all_reduce; break;
    case task_kind::reduce_scatter: call.kind = call_kind::reduce_scatter; break;
    case task_kind::all_gather: call.kind = call_kind::all_gather; break;
    case task_kind::broadcast: call.kind = call_kind::broadcast; break;
    case task_kind::all_to_all: call.kind = call_kind::all_to_all; break;
    case task_kind::barrier: call.kind = call_kind::barrier; break;
    case task_kind::send: call.kind = call_kind::send; break;
    case task_kind::recv: call.kind = call_kind::recv; break;
    case task_kind::p2p_wait: call.kind = task.p2p && task.p2p->sending ? call_kind::send : call_kind::recv; break;
    case task_kind::function: break;  // host work: never recorded
  }
  call.sequence = task.sequence;
  call.type = task.type;
  call.reduce = task.reduce;
  call.count = task.count;
  call.tag = task.tag;
  call.peer = call.kind == call_kind::broadcast || detail::is_point_to_point(call.kind) ? task.peer : -1;
  call.context = task.context;
  return call;
}

COHORT_COLD_BODY auto gloo::describe(const detail::gloo_task& task) -> std::string {
  if (task.what == task_kind::function) return "host_task";
  return detail::describe(as_call(task));
}

COHORT_COLD_BODY auto gloo::run(detail::gloo_task& task) -> void {
  // A point-to-point call starts when posted and completes when its wait does.
  if (task.what != task_kind::p2p_wait) recorder_.started(task.record);
  const bool collective = task.what != task_kind::function && task.what != task_kind::send &&
                          task.what != task_kind::recv && task.what != task_kind::p2p_wait;
  // What the progress monitor watches: the collective running now, by its task (described
  // only when the monitor asks), under one uncontended lock at its start and end.
  struct running_scope {
    gloo& group;
    bool active;
    running_scope(gloo& g, bool on, const detail::gloo_task& task) : group(g), active(on) {
      if (!active) return;
      const auto now = std::chrono::steady_clock::now();
      std::lock_guard lock(group.running_mutex_);
      group.running_ = &task;
      group.running_since_ = now;
    }
    ~running_scope() {
      if (!active) return;
      std::lock_guard lock(group.running_mutex_);
      group.running_ = nullptr;
    }
  } running{*this, collective, task};
  // The caller's thread runs queued calls when it waits (fifo_worker): Gloo writes from it
  // too, and so does the failure path (explain probes each peer's pair, which may write to
  // a socket whose peer is gone: a shared-memory wait can fail before Gloo's event loop has
  // seen the connection close). A no-op on cohort's own threads, which block SIGPIPE for good.
  std::optional<detail::sigpipe_blocked> writes_fail_with_epipe;
  if (task.what != task_kind::function && size_ > 1) writes_fail_with_epipe.emplace();
  try {
    execute(task);
  } catch (...) {
    recorder_.failed(task.record);
    const std::exception_ptr failure = explain(task, std::current_exception());
    keep_trace(failure);
    std::rethrow_exception(failure);
  }
  if (collective) collectives_completed_.fetch_add(1, std::memory_order_relaxed);
  if (task.what == task_kind::p2p_wait)
    recorder_.completed(task.record, 0);
  else if (task.what != task_kind::send && task.what != task_kind::recv)
    recorder_.completed(task.record, task.sequence);
}

COHORT_COLD_BODY auto gloo::explain(const detail::gloo_task& task, std::exception_ptr raised) -> std::exception_ptr {
  try {
    std::rethrow_exception(std::move(raised));
  } catch (const error&) {
    return std::current_exception();
  } catch (const ::gloo::IoException& failure) {
    const std::string what = failure.what();
    return explain_transport_failure(
        task, what, what.find("Timed out") != std::string::npos || what.find("timed out") != std::string::npos);
  } catch (const detail::shared_memory_failure& failure) {
    // A subgroup's peer by world rank, as the rest of its message.
    return explain_transport_failure(
        task, board_ ? failure.text_naming_peer(board_->names()) : std::string(failure.what()), failure.timed_out());
  } catch (const std::exception& failure) {
    return std::make_exception_ptr(error(world_rank_, detail::text("gloo.", describe(task)), failure.what(),
                                         "sizes or dtypes may differ across ranks (set COHORT_DEBUG=1 to check)"));
  } catch (...) {
    return std::current_exception();
  }
}

COHORT_COLD_BODY auto gloo::explain_transport_failure(const detail::gloo_task& task, const std::string& what,
                                                      bool timed_out) -> std::exception_ptr {
  std::string verdict;
  {
    std::lock_guard lock(verdict_mutex_);
    if (collision_) return collision_;  // the watchdog ended the call: the job is two jobs mixed
    verdict = verdict_;
  }
  // A subgroup's errors say which group, and name its ranks by world rank.
  const std::string group = board_ ? board_->names().lead() : std::string();
  if (!verdict.empty())  // the progress monitor ended the call: the ranks are in different calls
    return std::make_exception_ptr(error(world_rank_, detail::text("gloo.", describe(task)),
                                         detail::text(group, verdict), detail::different_calls_hint));
  const std::string culprit = detail::text(group, name_the_culprit(task, !timed_out));
  // The peers' statuses may show the cause themselves: ranks in different calls.
  if (culprit.find(detail::different_calls) != std::string::npos)
    return std::make_exception_ptr(error(world_rank_, detail::text("gloo.", describe(task)),
                                         detail::text(culprit, " [", what, "]"), detail::different_calls_hint));
  if (timed_out)
    return std::make_exception_ptr(timeout_error(
        world_rank_, detail::text("gloo.", describe(task)), detail::text(culprit, " [", what, "]"),
        detail::text("a peer did not enter the same call within ", detail::format_duration(options_.timeout),
                     ": it hangs, crashed, issued calls in another order, or "
                     "passed another size or dtype (COHORT_DEBUG=1 names the calls)")));
  return std::make_exception_ptr(error(world_rank_, detail::text("gloo.", describe(task)),
                                       detail::text(culprit, " [", what, "]"),
                                       "a peer closed its connection: it crashed or exited early, or sizes differ "
                                       "across ranks"));
}

COHORT_COLD_BODY auto gloo::execute(detail::gloo_task& task) -> void {
  switch (task.what) {
    case task_kind::function:
      if (task.fn) task.fn();
      return;
    case task_kind::p2p_wait: {
      worker_->wait_until_done(task.p2p->post_sequence, std::chrono::steady_clock::time_point::max());
      if (auto failure = worker_->failure(task.p2p->post_sequence)) std::rethrow_exception(failure);
      if (task.p2p->debug) check_p2p_pair(task);
      ::gloo::transport::UnboundBuffer* buffer = nullptr;
      {
        std::lock_guard lock(task.p2p->mutex);
        buffer = task.p2p->buffer.get();
      }
      if (!buffer) return;  // zero elements: nothing was posted
      const bool completed =
          task.p2p->sending ? buffer->waitSend(options_.timeout) : buffer->waitRecv(options_.timeout);
      {
        std::lock_guard lock(task.p2p->mutex);
        task.p2p->buffer.reset();
      }
      if (!completed) throw_timeout(task);
      return;
    }
    case task_kind::barrier: {
      ::gloo::BarrierOptions opts(context_);
      opts.setTag(collective_tag(task));
      opts.setTimeout(options_.timeout);
      ::gloo::barrier(opts);
      return;
    }
    default: break;
  }
  if (task.count == 0) return;  // nothing moves; every rank agrees on that without talking
  if (shared_memory_ && execute_in_shared_memory(task)) return;
  // Gloo's buffers care about the element's width only; the arithmetic is the reduce
  // function's. Four widths, not seven dtypes, of the code below.
  switch (size_of(task.type)) {
    case 1: return execute_sized<detail::element_bytes<1>>(task);
    case 2: return execute_sized<detail::element_bytes<2>>(task);
    case 4: return execute_sized<detail::element_bytes<4>>(task);
    default: return execute_sized<detail::element_bytes<8>>(task);
  }
}

COHORT_COLD_BODY auto gloo::execute_in_shared_memory(detail::gloo_task& task) -> bool {
  const std::size_t element = size_of(task.type);
  const std::size_t world = static_cast<std::size_t>(size_);
  const auto* in = static_cast<const std::byte*>(task.in);
  auto* out = static_cast<std::byte*>(task.out);
  // Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte.
  const auto overlap = [](const std::byte* a, std::size_t a_bytes, const std::byte* b, std::size_t b_bytes) {
    return a < b + b_bytes && b < a + a_bytes;
  };
  // An input that overlaps the output other than as the channel expects (in place; a
  // reduce-scatter's output at a block of its input; an all-gather's input as its own block)
  // is copied first, here: the transport is the group's choice, never one rank's from its own
  // buffers (ranks that chose differently would wait on each other until the timeout).
  const auto staged = [&](std::size_t in_bytes) -> const std::byte* {
    auto& copy = scratch_bytes(in_bytes);
    std::memcpy(copy.data(), in, in_bytes);
    return copy.data();
  };
  detail::shared_memory_channel::reduction reduce;
  reduce.combine = detail::reduce_function(task.type, task.reduce);
  reduce.divided = detail::sum_divided_function(task.type);
  reduce.sum_in_rank_order = detail::rank_order_sum_function(task.type, task.reduce);
  reduce.divisor = task.reduce == op::avg ? size_ : 1;
  const std::uint64_t call = signature(task) | 1;  // never 0, which means "any call"
  const std::size_t bytes = task.count * element;
  switch (task.what) {
    case task_kind::all_reduce:
      if (in != out && overlap(in, bytes, out, bytes)) in = staged(bytes);
      shared_memory_->all_reduce(in, out, task.count, element, reduce, call, options_.timeout);
      return true;
    case task_kind::reduce_scatter: {
      const bool aligned = out >= in && static_cast<std::size_t>(out - in) % bytes == 0;
      if (overlap(in, world * bytes, out, bytes) && !aligned) in = staged(world * bytes);
      shared_memory_->reduce_scatter(in, out, task.count, element, reduce, call, options_.timeout);
      return true;
    }
    case task_kind::all_gather: {
      const std::byte* own_block = out + static_cast<std::size_t>(rank_) * bytes;
      if (in != own_block && overlap(in, bytes, out, world * bytes)) in = staged(bytes);
      shared_memory_->all_gather(in, out, task.count, element, call, options_.timeout);
      return true;
    }
    case task_kind::all_to_all:
      // Each round holds one element of every rank's part at least: else TCP (the same on
      // every rank: the slot, the world and the dtype are).
      if (world * element > shared_memory_->slot_bytes()) return false;
      if (overlap(in, world * bytes, out, world * bytes)) in = staged(world * bytes);
      shared_memory_->all_to_all(in, out, task.count, element, call, options_.timeout);
      return true;
    default: return false;
  }
}

COHORT_COLD_BODY auto gloo::signature(const detail::gloo_task& task) -> std::uint64_t {
  detail::fnv1a hash;
  const auto mix = [&](std::uint64_t value) { hash.mix(value); };
  // A send and its recv must share a slot: both count as "point to point".
  const bool point_to_point =
      task.what == task_kind::send || task.what == task_kind::recv || task.what == task_kind::p2p_wait;
  mix(point_to_point ? 0xffu : static_cast<std::uint64_t>(task.what));
  mix(static_cast<std::uint64_t>(task.type));
  mix(task.count);
  mix(static_cast<std::uint64_t>(task.reduce));
  if (task.what == task_kind::broadcast) mix(static_cast<std::uint64_t>(task.peer));
  if (point_to_point) mix(task.tag);
  mix(task.sequence);
  return hash.value();
}

COHORT_COLD_BODY auto gloo::throw_timeout(const detail::gloo_task& task) -> void {
  throw timeout_error(world_rank_, detail::text("gloo.", describe(task)),
                      detail::text("no matching peer operation within ", detail::format_duration(options_.timeout)),
                      "the peer never posted the matching send/recv with the same tag, size and dtype");
}

COHORT_COLD_BODY auto gloo::name_the_culprit(const detail::gloo_task& task, bool connection_lost) -> std::string {
  const std::string mine = describe(task);
  const bool collective = task.what != task_kind::send && task.what != task_kind::recv &&
                          task.what != task_kind::p2p_wait && task.what != task_kind::function;
  const bool point_to_point =
      task.what == task_kind::send || task.what == task_kind::recv || task.what == task_kind::p2p_wait;
  if (point_to_point && board_) {
    // One peer: what it said of itself, after this rank said what failed (before the
    // connections close, as for a collective below).
    auto failed = status(detail::rank_activity::failed);
    failed.call = as_call(task);
    failed.note = connection_lost ? "a connection closed"
                                  : detail::text("timed out after ", detail::format_duration(options_.timeout));
    board_->try_publish_on_group_store(failed);
    abort_transport();
    return detail::name_the_peer(*board_, failed.call, connection_lost);
  }
  if (!board_ || !collective) {
    abort_transport();
    return point_to_point && connection_lost
               ? detail::text(names_.lead(), names_(task.peer),
                              " (the peer) closed its connection: it died or exited during ", mine)
               : detail::text("this rank is in ", (point_to_point ? detail::describe_with_peer(as_call(task)) : mine));
  }
  // What each peer is, as its connection tells it now; then the connections close, so that
  // every rank in this call (or entering one) stops at once and reports, instead of waiting
  // for this one until its own timeout.
  std::vector<detail::peer_status> known(static_cast<std::size_t>(size_));
  for (int peer = 0; peer < size_; ++peer)
    if (peer != rank_) known[static_cast<std::size_t>(peer)] = probe_peer(peer);
  // Ranks that die together (a node) close their connections within milliseconds of each
  // other, and Gloo's event loop takes a moment to see each: asked once more after a moment,
  // those that still look alive are, as far as their connections can tell.
  if (std::any_of(known.begin(), known.end(),
                  [](const detail::peer_status& seen) { return seen.state != detail::peer_state::died; })) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    for (int peer = 0; peer < size_; ++peer)
      if (peer != rank_ && known[static_cast<std::size_t>(peer)].state != detail::peer_state::died)
        known[static_cast<std::size_t>(peer)] = probe_peer(peer);
  }
  auto failed = status(detail::rank_activity::failed);
  failed.call = as_call(task);
  failed.note = connection_lost ? "a connection closed"
                                : detail::text("timed out after ", detail::format_duration(options_.timeout));
  // Said before the connections close (a SET waits for no answer): a peer that fails because
  // they closed reads that this rank failed, not that it died.
  board_->try_publish_on_group_store(failed);
  abort_transport();
  return detail::name_the_culprit(*board_, failed.call, failed, connection_lost, known,
                                  [this](int peer) { return probe_host(peer); });
}

COHORT_COLD_BODY auto gloo::probe_peer(int peer) const -> detail::peer_status {
  using detail::peer_state;
  if (!context_ || peer < 0 || peer >= size_ || peers_.size() != static_cast<std::size_t>(size_)) return {};
  const auto& theirs = peers_[static_cast<std::size_t>(peer)];
  const auto& mine = peers_[static_cast<std::size_t>(rank_)];
  // On this host the process table is the truth: where the peer's pid is one of this table's
  // (a host of the same name may be a clone with a table of its own; one of another name is
  // treated as another host, whatever it shares) and not this process (ranks as threads share it).
  using seen = detail::process_seen;
  const seen process = theirs.host == mine.host && !mine.process_table.empty() &&
                               theirs.process_table == mine.process_table && theirs.pid != mine.pid
                           ? detail::look_up_process(theirs.pid)
                           : seen::unknown;
  if (process == seen::gone) return {peer_state::died, "its process is gone", true};
  if (process == seen::stopped)
    return {peer_state::stopped, "its process is stopped: SIGSTOP, a debugger or a terminal's ^Z", true};
  // Gloo's event loop watches every connected pair, busy or not: a peer whose process ended
  // has its pair failed with the reason, which any operation on the pair rethrows before
  // doing anything. On a healthy pair this zero-byte receive is posted on a slot nobody
  // sends to (the group has failed; the peer only counts the notice), and dropped at once.
  // (Debian's libgloo lacks a header that tcp::Pair needs, so its side-effect-free
  // tryRecv is out of reach.)
  std::string failure;
  try {
    auto& pair = context_->getPair(peer);
    if (!pair) return {};
    auto nothing = context_->createUnboundBuffer(nullptr, 0);
    constexpr std::uint64_t unused_slot = 0x7fffffffffffffffull;  // above Gloo's and cohort's slots
    pair->recv(nothing.get(), unused_slot, 0, 0);
  } catch (const std::exception& closed) {
    failure = closed.what();
  }
  const bool runs = process == seen::running;
  if (failure.empty()) return {peer_state::alive, "connected", runs};
  // A closed connection with its process running: the peer is failing (or ending) itself.
  for (const char* closed_by_peer : {"closed by peer", "reset by peer", "Broken pipe", "Socket closed"})
    if (failure.find(closed_by_peer) != std::string::npos)
      return runs ? detail::peer_status{peer_state::closed, "its connection closed, but its process runs", true}
                  : detail::peer_status{peer_state::closed,
                                        (process == seen::unknown && theirs.pid == mine.pid)
                                            ? "its connection closed"
                                            : "its connection closed; its process is on another host",
                                        false};
  // The pair failed on this side (a timeout): alive but silent, or cut off? (probe_host)
  if (runs) return {peer_state::alive, "its process runs", true};
  return {};
}

COHORT_COLD_BODY auto gloo::probe_host(int peer) const -> detail::peer_status {
  using detail::peer_state;
  if (!context_ || peer < 0 || peer >= size_ || peers_.size() != static_cast<std::size_t>(size_)) return {};
  // A host that answers a connection attempt at all (refused counts) is reachable.
  const auto bound = std::min<std::chrono::milliseconds>(options_.timeout, std::chrono::seconds(1));
  std::string why;
  if (detail::host_answers(peer_pair_address(peer), bound, why)) return {peer_state::alive, "its host answers"};
  return {peer_state::unreachable, why};
}

COHORT_COLD_BODY auto gloo::p2p_debug_key(const detail::gloo_task& task, bool mine) const -> std::string {
  // Both sides name the pair the same way: sender, receiver, tag, the pair's sequence number.
  const bool sending = task.what == task_kind::send || (task.p2p && task.p2p->sending);
  const int from = sending ? rank_ : task.peer;
  const int to = sending ? task.peer : rank_;
  const bool send_side = mine ? sending : !sending;
  return detail::text("p2p/", std::to_string(from), "-", std::to_string(to), "/", std::to_string(task.tag), "/",
                      std::to_string(task.sequence), (send_side ? "/send" : "/recv"));
}

COHORT_COLD_BODY auto gloo::check_p2p_pair(const detail::gloo_task& task) -> void {
  const bool sending = task.p2p->sending;
  const std::string mine = detail::text(to_string(task.type), " x ", std::to_string(task.count));
  const std::string pair =
      detail::text((sending ? "send #" : "recv #"), std::to_string(task.sequence), (sending ? " to " : " from "),
                   names_(task.peer), " (tag ", std::to_string(task.tag), ")");
  std::string theirs;
  try {
    theirs = to_string(store_->get(p2p_debug_key(task, false), options_.timeout));
  } catch (const timeout_error&) {
    throw timeout_error(
        world_rank_, detail::text("gloo.", describe(task)),
        detail::text(names_.lead(), names_(task.peer), " never posted the ", (sending ? "recv" : "send"),
                     " matching this rank's ", pair, " within ", detail::format_duration(options_.timeout)),
        "every send needs a recv on the peer with the same tag, in the same order");
  }
  if (theirs == mine) return;
  const std::string sender = names_(sending ? rank_ : task.peer);
  const std::string receiver = names_(sending ? task.peer : rank_);
  throw error(world_rank_, detail::text("gloo.", describe(task)),
              detail::text(names_.lead(), sender, " sends ", (sending ? mine : theirs), " to ", receiver, " (tag ",
                           std::to_string(task.tag), ", #", std::to_string(task.sequence), ") but ", receiver,
                           "'s matching recv expects ", (sending ? theirs : mine)),
              "a send and its recv must move the same dtype and number of elements");
}

COHORT_COLD_BODY auto gloo::missing_at_rendezvous(cohort::store& store) const -> std::string {
  std::vector<int> missing;
  try {
    // A handle of its own, bounded: the group's waits as long as the store's timeout.
    const auto own = store.bounded(std::min<std::chrono::milliseconds>(options_.timeout, std::chrono::seconds(5)));
    cohort::store& asked = own ? *own : store;
    for (int peer = 0; peer < size_; ++peer) {
      const std::string key = detail::text("gloo/", std::to_string(peer));
      if (!asked.check(std::span<const std::string>(&key, 1))) missing.push_back(peer);
    }
  } catch (const std::exception&) {
    const std::string where = store.location();
    return detail::text("the store", (where.empty() ? std::string() : detail::text(" at ", where)), " is unreachable");
  }
  if (missing.empty()) return "every rank published its address";
  return detail::text(names_(missing), " never arrived at the rendezvous");
}

COHORT_COLD_BODY auto gloo::rendezvous_context() const -> std::string {
  return detail::text(" (", (names_.is_world() ? "world" : "group"), " of ", std::to_string(size_),
                      "; this rank published ", address_, ")");
}

COHORT_COLD_BODY auto gloo::scratch_bytes(std::size_t bytes) -> std::vector<std::byte>& {
  if (scratch_.size() < bytes) scratch_.resize(bytes);
  return scratch_;
}

COHORT_COLD_BODY auto gloo::all_reduce_in_rank_order(detail::gloo_task& task) -> void {
  // A 16-bit float's sum or average: Gloo's ring would round every partial sum to 16 bits, in
  // an order of its own. Instead each rank gathers every rank's contributions to its block
  // (an all-to-all), adds them in rank order in float, rounds once, and the blocks are
  // gathered: the bits the shared-memory channel gives, and the same bytes on the wire as the
  // ring's reduce-scatter and all-gather.
  const auto sum = detail::rank_order_sum_function(task.type, task.reduce);
  const std::size_t element = size_of(task.type);
  const std::size_t world = static_cast<std::size_t>(size_);
  const std::size_t block = (task.count + world - 1) / world;
  const std::size_t bytes = world * block * element;
  auto& scratch = scratch_bytes(2 * bytes);
  std::byte* blocks = scratch.data();  // this rank's input, padded to `world` blocks
  std::byte* gathered = blocks + bytes;
  std::memcpy(blocks, task.in, task.count * element);
  std::memset(blocks + task.count * element, 0, bytes - task.count * element);
  ::gloo::AlltoallOptions spread(context_);
  spread.setTag(collective_tag(task));
  spread.setInput(blocks, bytes);
  spread.setOutput(gathered, bytes);
  spread.setTimeout(options_.timeout);
  ::gloo::alltoall(spread);
  std::vector<const void*> parts(world);
  for (std::size_t r = 0; r < world; ++r) parts[r] = gathered + r * block * element;
  std::byte* mine = blocks + static_cast<std::size_t>(rank_) * block * element;
  sum(mine, parts.data(), world, block, task.reduce == op::avg ? size_ : 1);
  ::gloo::AllgatherOptions collect(context_);
  collect.setTag(collective_tag(task));
  collect.setOutput(blocks, bytes);
  collect.setTimeout(options_.timeout);
  ::gloo::allgather(collect);
  std::memcpy(task.out, blocks, task.count * element);
}

template <class T>
COHORT_DECL auto gloo::execute_sized(detail::gloo_task& task) -> void {
  T* out = static_cast<T*>(task.out);
  const T* in = static_cast<const T*>(task.in);
  const std::size_t n = task.count;
  const std::size_t world = static_cast<std::size_t>(size_);
  switch (task.what) {
    case task_kind::all_reduce: {
      // A 16-bit float's sum or average: not the ring (see all_reduce_in_rank_order).
      if (detail::rank_order_sum_function(task.type, task.reduce) != nullptr && size_ > 1)
        return all_reduce_in_rank_order(task);
      ::gloo::AllreduceOptions opts(context_);
      opts.setTag(collective_tag(task));
      // An average divides where Gloo completes each element's sum, not in a pass of its own
      // over the result. With two ranks every addition Gloo makes completes its elements' sum
      // (two parts, one addition, whatever the algorithm), so it divides as it adds, exactly
      // as the sum's quotient. With more, floats are divided as Gloo first reads them
      // (detail::average_step_into: the input given twice, whose local combination divides),
      // as NCCL's average pre-multiplies; integers sum and then divide, keeping the truncation
      // exact.
      const bool average = task.reduce == op::avg && size_ > 1;
      const bool divide_first = average && size_ > 2 && is_floating(task.type);
      if (average && size_ == 2) {
        if (in != out) opts.setInput(const_cast<T*>(in), n);
        opts.setReduceFunction(
            [divided = detail::sum_divided_function(task.type)](void* o, const void* a, const void* b,
                                                                std::size_t count) { divided(o, a, b, count, 2); });
      } else if (divide_first) {
        T* input = const_cast<T*>(in);
        opts.setInputs(std::vector<T*>{input, input}, n);
        opts.setReduceFunction(
            [step = detail::average_step_function(task.type), world = size_](
                void* o, const void* a, const void* b, std::size_t count) { step(o, a, b, count, world); });
      } else {
        // Out of place, Gloo copies each input segment just before it sends or reduces it,
        // while it is hot; a copy of the whole input first would be a cold pass of its own.
        if (in != out) opts.setInput(const_cast<T*>(in), n);
        opts.setReduceFunction(detail::reduce_function(task.type, task.reduce));
      }
      opts.setOutput(out, n);
      opts.setTimeout(options_.timeout);
      ::gloo::allreduce(opts);
      if (average && size_ > 2 && !divide_first) detail::host::divide(out, n, task.type, size_);
      return;
    }
    case task_kind::reduce_scatter: {
      // One rank's chunk is its input (out may overlap it).
      if (world == 1) {
        if (out != in) std::memmove(out, in, n * sizeof(T));
        return;
      }
      // All-to-all puts every rank's contribution to my chunk side by side, then one
      // local pass reduces them: (n-1)/n of the input crosses the wire.
      auto& scratch = scratch_bytes(world * n * sizeof(T));
      T* gathered = reinterpret_cast<T*>(scratch.data());
      {
        ::gloo::AlltoallOptions opts(context_);
        opts.setTag(collective_tag(task));
        opts.setInput(const_cast<T*>(in), world * n);
        opts.setOutput(gathered, world * n);
        opts.setTimeout(options_.timeout);
        ::gloo::alltoall(opts);
      }
      // The first addition reads the first two contributions where they lie and writes the
      // result (out may be inside `in`: the all-to-all has read it all), rather than a copy
      // of the first into out and then an addition: one pass over the chunk fewer. An average
      // divides in the last addition's pass, not in a pass of its own. A 16-bit float's sum
      // or average adds in float, rounding once, as its all-reduce does.
      if (const auto sum_in_rank_order = detail::rank_order_sum_function(task.type, task.reduce)) {
        std::vector<const void*> parts(world);
        for (std::size_t r = 0; r < world; ++r) parts[r] = gathered + r * n;
        sum_in_rank_order(out, parts.data(), world, n, task.reduce == op::avg ? size_ : 1);
        return;
      }
      const auto reduce = detail::reduce_function(task.type, task.reduce);
      const bool average = task.reduce == op::avg;
      for (std::size_t r = 1; r < world; ++r) {
        const T* left = r == 1 ? gathered : out;
        if (average && r + 1 == world)
          detail::sum_divided_function(task.type)(out, left, gathered + r * n, n, size_);
        else
          reduce(out, left, gathered + r * n, n);
      }
      return;
    }
    case task_kind::all_gather: {
      ::gloo::AllgatherOptions opts(context_);
      opts.setTag(collective_tag(task));
      T* own_slot = out + static_cast<std::size_t>(rank_) * n;
      if (in != own_slot) std::memcpy(own_slot, in, n * sizeof(T));
      opts.setOutput(out, world * n);
      opts.setTimeout(options_.timeout);
      ::gloo::allgather(opts);
      return;
    }
    case task_kind::broadcast: {
      ::gloo::BroadcastOptions opts(context_);
      opts.setTag(collective_tag(task));
      opts.setOutput(out, n);
      opts.setRoot(task.peer);
      opts.setTimeout(options_.timeout);
      ::gloo::broadcast(opts);
      return;
    }
    case task_kind::all_to_all: {
      if (world == 1) {
        if (in != out) std::memcpy(out, in, n * sizeof(T));
        return;
      }
      ::gloo::AlltoallOptions opts(context_);
      opts.setTag(collective_tag(task));
      opts.setInput(const_cast<T*>(in), world * n);
      opts.setOutput(out, world * n);
      opts.setTimeout(options_.timeout);
      ::gloo::alltoall(opts);
      return;
    }
    case task_kind::send: {
      auto buffer = context_->createUnboundBuffer(const_cast<T*>(in), n * sizeof(T));
      buffer->send(task.peer, point_to_point_slot(task));
      std::lock_guard lock(task.p2p->mutex);
      task.p2p->buffer = std::move(buffer);
      return;
    }
    case task_kind::recv: {
      auto buffer = context_->createUnboundBuffer(out, n * sizeof(T));
      buffer->recv(task.peer, point_to_point_slot(task));
      std::lock_guard lock(task.p2p->mutex);
      task.p2p->buffer = std::move(buffer);
      return;
    }
    default: return;
  }
}

}  // namespace cohort::inline v0
