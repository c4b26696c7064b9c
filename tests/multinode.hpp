#pragma once
// Simulated nodes for cohort's tests: network namespaces joined by a bridge, each with its
// own address, host name and /etc/hosts, and ranks as child processes inside them with the
// environment torchrun gives its workers. Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and the
// `ip` tool; cluster::make() says why not where they are missing, and the test skips.
//
// Every namespace, link and address lives in namespaces the cluster creates (the bridge in a
// "switch" namespace of its own): no traffic reaches the host's own network. The destructor
// deletes them all, and so does a later cluster of the same process id, should a test have
// been killed before it could.

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace cohort_test {

struct node {
  std::string netns;    // the namespace's name (ip netns)
  std::string address;  // its address on the bridge (10.231.<subnet>.<index + 1>/24)
  std::string hostname;
  // /etc/hosts inside the node: name -> address lines; filled by the test.
  std::vector<std::pair<std::string, std::string>> hosts;
  std::vector<std::string> extra_addresses;  // added to the node's loopback (a /32 each)
  // Each rank in a pid namespace of its own (as on another machine), its pids numbered from
  // one this machine's namespace does not use: the same number names another process, or none.
  bool own_pids = false;
};

class cluster {
 public:
  // Null, with `why` set, where namespaces cannot be made here.
  static std::unique_ptr<cluster> make(int nodes, std::string& why) {
    if (::geteuid() != 0) {
      why = "simulated nodes need root (network namespaces)";
      return nullptr;
    }
    if (std::system("ip -V >/dev/null 2>&1") != 0) {
      why = "the ip tool (iproute2) is missing";
      return nullptr;
    }
    std::unique_ptr<cluster> made(new cluster(nodes));
    if (!made->build(why)) return nullptr;
    return made;
  }
  cluster(const cluster&) = delete;
  cluster& operator=(const cluster&) = delete;
  ~cluster() { teardown(); }

  std::vector<node>& nodes() { return nodes_; }
  // Runs `command` in the node's namespace (ip netns exec); its exit status.
  int exec(int index, const std::string& command) const {
    return std::system(("ip netns exec " + nodes_[static_cast<std::size_t>(index)].netns + " " + command).c_str());
  }
  // Takes the node's link down: a partition, as pulling its cable makes one.
  void unplug(int index) const { run("ip -n " + switch_ + " link set " + peer_end(index) + " down"); }

  // Faults on the node's own end of its link, where the kernel has the facility; each
  // returns false with `why` naming the missing one, so the test can skip saying so.
  // Delay of every packet the node sends (tc netem: the kernel's CONFIG_NET_SCH_NETEM).
  bool delay(int index, std::chrono::milliseconds by, std::string& why) const {
    if (std::system("tc -V >/dev/null 2>&1") != 0) {
      why = "the tc tool (iproute2) is missing";
      return false;
    }
    if (!run_in(index,
                "tc qdisc replace dev " + end(index) + " root netem delay " + std::to_string(by.count()) + "ms")) {
      why = "the kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): tc cannot delay packets here";
      return false;
    }
    return true;
  }
  // A rate limit on what the node sends (tc tbf).
  bool limit_rate(int index, const std::string& rate, std::string& why) const {
    if (!run_in(index,
                "tc qdisc replace dev " + end(index) + " root tbf rate " + rate + " burst 256kb latency 100ms")) {
      why = "tc cannot add a tbf qdisc here (the tc tool, or the kernel's CONFIG_NET_SCH_TBF, is missing)";
      return false;
    }
    return true;
  }
  // Whether drop() can work here: a rule added and removed on node 0 (for a documentation
  // address, TEST-NET-1, so nothing is dropped meanwhile).
  bool can_drop(std::string& why) const {
    if (std::system("iptables -V >/dev/null 2>&1") != 0) {
      why = "iptables is missing (apt-get install iptables)";
      return false;
    }
    if (!run_in(0, "iptables -w -A INPUT -s 192.0.2.1 -j DROP") ||
        !run_in(0, "iptables -w -D INPUT -s 192.0.2.1 -j DROP")) {
      why = "iptables cannot add a DROP rule here (the kernel's netfilter is missing?)";
      return false;
    }
    return true;
  }
  // Drops each packet into or out of the node with `probability` (iptables' statistic
  // match, the kernel's xt_statistic); 1.0 drops all: a partition that leaves the link up.
  // Dropped where packets arrive, on the node and on every other node (from its address):
  // a DROP in OUTPUT would fail the sender's call with EPERM, which no real loss does.
  bool drop(int index, double probability, std::string& why) const {
    if (std::system("iptables -V >/dev/null 2>&1") != 0) {
      why = "iptables is missing (apt-get install iptables)";
      return false;
    }
    const std::string match =
        probability >= 1.0 ? std::string() : " -m statistic --mode random --probability " + std::to_string(probability);
    bool ok = run_in(index, "iptables -w -A INPUT -i " + end(index) + match + " -j DROP");
    for (int other = 0; ok && other < static_cast<int>(nodes_.size()); ++other)
      if (other != index)
        ok = run_in(other,
                    "iptables -w -A INPUT -s " + nodes_[static_cast<std::size_t>(index)].address + match + " -j DROP");
    if (!ok)
      why = "iptables cannot add a DROP rule here" +
            std::string(match.empty() ? "" : " with the statistic match (is the kernel's xt_statistic missing?)");
    return ok;
  }

  // Starts one child process per entry of `ranks` (node index, environment), inside the
  // node: its namespace, host name and hosts file. Each child runs body() and exits with its
  // value (99 on an exception, printed).
  struct rank_process {
    int node = 0;
    std::map<std::string, std::string> env;
    std::chrono::milliseconds delay{0};  // started this long after the others
  };
  std::vector<pid_t> start(const std::vector<rank_process>& ranks, const std::function<int()>& body) const {
    return start(ranks, body, nullptr);
  }
  // The same, and (outputs not null) each child's stdout and stderr go to a pipe whose read end
  // is appended to *outputs (read them with collect()).
  std::vector<pid_t> start(const std::vector<rank_process>& ranks, const std::function<int()>& body,
                           std::vector<int>* outputs) const {
    std::vector<pid_t> children;
    std::fflush(nullptr);  // or the children would print the test's buffered output again
    for (const auto& rank : ranks) {
      int ends[2] = {-1, -1};
      if (outputs && ::pipe2(ends, O_CLOEXEC) != 0) ends[0] = ends[1] = -1;
      const pid_t pid = ::fork();
      if (pid == 0) {
        if (ends[1] >= 0) {
          ::dup2(ends[1], 1);
          ::dup2(ends[1], 2);
        }
        if (rank.delay.count() > 0) std::this_thread::sleep_for(rank.delay);
        ::_exit(enter_and_run(nodes_[static_cast<std::size_t>(rank.node)], rank.env, body));
      }
      if (ends[1] >= 0) ::close(ends[1]);
      if (outputs) outputs->push_back(ends[0]);
      children.push_back(pid);
    }
    return children;
  }

 private:
  explicit cluster(int nodes) : tag_("c" + std::to_string(::getpid() % 100000)) {
    subnet_ = 1 + ::getpid() % 250;
    switch_ = tag_ + "-sw";
    for (int i = 0; i < nodes; ++i) {
      node n;
      n.netns = tag_ + "-n" + std::to_string(i);
      n.address = "10.231." + std::to_string(subnet_) + "." + std::to_string(i + 1);
      n.hostname = "node" + std::to_string(i);
      nodes_.push_back(n);
    }
  }

  std::string end(int index) const { return tag_ + "-" + std::to_string(index) + "a"; }
  std::string peer_end(int index) const { return tag_ + "-" + std::to_string(index) + "b"; }

  static bool run(const std::string& command) { return std::system((command + " >/dev/null 2>&1").c_str()) == 0; }
  bool run_in(int index, const std::string& command) const {
    return run("ip netns exec " + nodes_[static_cast<std::size_t>(index)].netns + " " + command);
  }

  bool build(std::string& why) {
    teardown();  // a killed earlier run of this process id may have left them
    bool ok = run("ip netns add " + switch_) && run("ip -n " + switch_ + " link add br0 type bridge") &&
              run("ip -n " + switch_ + " link set br0 up");
    for (int i = 0; ok && i < static_cast<int>(nodes_.size()); ++i) {
      const auto& n = nodes_[static_cast<std::size_t>(i)];
      ok = run("ip netns add " + n.netns) && run("ip link add " + end(i) + " type veth peer name " + peer_end(i)) &&
           run("ip link set " + end(i) + " netns " + n.netns) &&
           run("ip link set " + peer_end(i) + " netns " + switch_) &&
           run("ip -n " + switch_ + " link set " + peer_end(i) + " master br0") &&
           run("ip -n " + switch_ + " link set " + peer_end(i) + " up") &&
           run("ip -n " + n.netns + " addr add " + n.address + "/24 dev " + end(i)) &&
           run("ip -n " + n.netns + " link set " + end(i) + " up") && run("ip -n " + n.netns + " link set lo up");
    }
    if (!ok) {
      why = "could not build network namespaces and a bridge (ip netns, veth, bridge)";
      teardown();
    }
    return ok;
  }

  void teardown() const {
    for (const auto& n : nodes_) run("ip netns del " + n.netns);
    run("ip netns del " + switch_);
  }

  static int enter_and_run(const node& n, const std::map<std::string, std::string>& env,
                           const std::function<int()>& body) {
    const int fd = ::open(("/var/run/netns/" + n.netns).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) return 98;
    ::close(fd);
    // Its own host name and /etc/hosts: a UTS namespace, and a mount namespace in which a
    // file of its own is bound over /etc/hosts (private, so the host's stays as it is).
    if (::unshare(CLONE_NEWUTS | CLONE_NEWNS) != 0) return 98;
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return 98;
    if (::sethostname(n.hostname.c_str(), n.hostname.size()) != 0) return 98;
    for (const auto& extra : n.extra_addresses)
      if (std::system(("ip addr replace " + extra + "/32 dev lo").c_str()) != 0) return 98;
    const std::string hosts = "/tmp/cohort-hosts-" + std::to_string(::getpid());
    {
      std::ofstream out(hosts);
      out << "127.0.0.1 localhost\n";
      for (const auto& [name, address] : n.hosts) out << address << " " << name << "\n";
    }
    if (::mount(hosts.c_str(), "/etc/hosts", nullptr, MS_BIND, nullptr) != 0) return 98;
    ::unlink(hosts.c_str());  // the bind keeps it
    if (n.own_pids) return run_in_own_pid_namespace([&] { return run_body(n, env, body); });
    return run_body(n, env, body);
  }

  // Runs `run` as a process of a new pid namespace (with its own /proc), whose pid is one
  // that no process of this machine's namespace has; returns its exit status. Killing the
  // caller kills it (and the namespace) too.
  static int run_in_own_pid_namespace(const std::function<int()>& run) {
    pid_t unused = 100000;
    while (::kill(unused, 0) == 0 || errno != ESRCH) ++unused;
    if (::unshare(CLONE_NEWPID) != 0) return 98;
    const auto exit_status = [](pid_t child) {
      int status = 0;
      while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {}
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    };
    const pid_t init = ::fork();
    if (init != 0) return init < 0 ? 98 : exit_status(init);
    // The namespace's init (pid 1, which ignores the signals it has no handler for: a rank
    // must not be it), with its own /proc; the rank is its child.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr) != 0) ::_exit(98);
    std::ofstream("/proc/sys/kernel/ns_last_pid") << (unused - 1);
    const pid_t rank = ::fork();
    if (rank == 0) ::_exit(run());
    ::_exit(rank < 0 ? 98 : exit_status(rank));
  }

  static int run_body(const node& n, const std::map<std::string, std::string>& env, const std::function<int()>& body) {
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                             "GLOO_SOCKET_IFNAME", "COHORT_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"})
      ::unsetenv(name);
    for (const auto& [name, value] : env) ::setenv(name.c_str(), value.c_str(), 1);
    int code = 99;
    try {
      code = body();
    } catch (const std::exception& failure) {
      std::fprintf(stderr, "[%s] %s\n", n.hostname.c_str(), failure.what());
    }
    std::fflush(nullptr);
    return code;
  }

  std::string tag_;
  int subnet_ = 1;
  std::string switch_;
  std::vector<node> nodes_;
};

// What one child printed, line by line, each with the seconds since `start` when it came, and
// when it exited.
struct transcript {
  std::vector<std::pair<double, std::string>> lines;
  double exited = -1;  // seconds since start; -1: killed at the limit
  int code = -1;

  std::string text() const {
    std::string all;
    for (const auto& [at, line] : lines) all += line + "\n";
    return all;
  }
  bool says(const std::string& needle) const { return text().find(needle) != std::string::npos; }
  // The longest stretch without a line, from `from` (seconds since start) to the exit.
  double longest_silence(double from) const {
    double last = from, longest = 0;
    for (const auto& [at, line] : lines)
      if (at >= from) {
        longest = std::max(longest, at - last);
        last = at;
      }
    if (exited >= 0) longest = std::max(longest, exited - last);
    return longest;
  }
};

// Waits for the children of start(..., outputs), reading what they print as it comes; any
// still running after `limit` is killed. `start` is when they were started. With `awaited`,
// only the first `awaited` children are waited for and the others killed once those have
// exited: a child the test stopped (SIGSTOP) would otherwise hold it for the whole limit.
inline std::vector<transcript> collect(std::vector<pid_t> children, std::vector<int> outputs,
                                       std::chrono::steady_clock::time_point start, std::chrono::seconds limit,
                                       std::size_t awaited = SIZE_MAX) {
  std::vector<transcript> out(children.size());
  std::vector<std::string> partial(children.size());
  const auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  const auto deadline = start + limit;
  awaited = std::min(awaited, children.size());
  const auto awaited_done = [&] {
    for (std::size_t i = 0; i < awaited; ++i)
      if (children[i] != 0 || outputs[i] >= 0) return false;
    return true;
  };
  while (true) {
    std::vector<pollfd> watch;
    std::vector<std::size_t> owner;
    for (std::size_t i = 0; i < outputs.size(); ++i)
      if (outputs[i] >= 0) {
        watch.push_back({outputs[i], POLLIN, 0});
        owner.push_back(i);
      }
    if (awaited_done()) break;
    if (std::chrono::steady_clock::now() >= deadline) break;
    ::poll(watch.data(), watch.size(), 20);
    for (std::size_t k = 0; k < watch.size(); ++k) {
      if (!(watch[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const std::size_t i = owner[k];
      char chunk[4096];
      const ssize_t got = ::read(outputs[i], chunk, sizeof chunk);
      if (got <= 0) {
        ::close(outputs[i]);
        outputs[i] = -1;
        if (!partial[i].empty()) out[i].lines.emplace_back(seconds(), partial[i]);
        continue;
      }
      partial[i].append(chunk, static_cast<std::size_t>(got));
      for (std::size_t end; (end = partial[i].find('\n')) != std::string::npos;) {
        out[i].lines.emplace_back(seconds(), partial[i].substr(0, end));
        partial[i].erase(0, end + 1);
      }
    }
    for (std::size_t i = 0; i < children.size(); ++i) {
      int status = 0;
      if (children[i] == 0 || ::waitpid(children[i], &status, WNOHANG) != children[i]) continue;
      out[i].code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      out[i].exited = seconds();
      children[i] = 0;
    }
  }
  for (std::size_t i = 0; i < children.size(); ++i)
    if (children[i] != 0) {
      ::kill(children[i], SIGKILL);
      ::waitpid(children[i], nullptr, 0);
    }
  for (auto fd : outputs)
    if (fd >= 0) ::close(fd);
  return out;
}

// Waits for the children; any still running after `limit` is killed and reported as -1.
inline std::vector<int> wait_children(std::vector<pid_t> children, std::chrono::seconds limit) {
  std::vector<int> codes(children.size(), -1);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::size_t remaining = children.size();
  while (remaining > 0 && std::chrono::steady_clock::now() < deadline) {
    for (std::size_t i = 0; i < children.size(); ++i) {
      int status = 0;
      if (children[i] == 0 || ::waitpid(children[i], &status, WNOHANG) != children[i]) continue;
      codes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      children[i] = 0;
      --remaining;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (auto pid : children)
    if (pid != 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  return codes;
}

}  // namespace cohort_test
