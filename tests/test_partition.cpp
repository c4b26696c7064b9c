// A rank cut off from the rest: what it and the others say, and how soon. The cut is a
// proxy between one rank and the store that stops forwarding (and accepting) at a moment the
// test chooses, which is what a partition looks like to both ends of a TCP connection:
// nothing is closed, nothing arrives.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cohort/comm/gloo.hpp>
#include <cohort/comm/process_group.hpp>
#include <cohort/rendezvous/tcp_store.hpp>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "support.hpp"

using Catch::Matchers::Contains;

namespace {

// Forwards 127.0.0.1:port() to 127.0.0.1:target until frozen; cut() closes every connection.
class freezable_proxy {
 public:
  explicit freezable_proxy(std::uint16_t target) : target_(target) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof address);
    ::listen(listener_, 16);
    socklen_t length = sizeof address;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { loop(); });
  }
  freezable_proxy(const freezable_proxy&) = delete;
  freezable_proxy& operator=(const freezable_proxy&) = delete;
  ~freezable_proxy() {
    stop_ = true;
    thread_.join();
    for (auto [a, b] : links_) {
      ::close(a);
      ::close(b);
    }
    ::close(listener_);
  }
  std::uint16_t port() const { return port_; }
  void freeze() { frozen_ = true; }
  void cut() { cut_ = true; }

 private:
  void loop() {
    char buffer[1 << 16];
    while (!stop_) {
      if (cut_) {
        for (auto [a, b] : links_) {
          ::close(a);
          ::close(b);
        }
        links_.clear();
        cut_ = false;
      }
      if (frozen_) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      std::vector<pollfd> fds{{listener_, POLLIN, 0}};
      for (auto [a, b] : links_) {
        fds.push_back({a, POLLIN, 0});
        fds.push_back({b, POLLIN, 0});
      }
      if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        const int client = ::accept(listener_, nullptr, nullptr);
        const int upstream = ::socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in address{};
        address.sin_family = AF_INET;
        address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        address.sin_port = htons(target_);
        if (client >= 0 && ::connect(upstream, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) {
          links_.emplace_back(client, upstream);
        } else {
          if (client >= 0) ::close(client);
          ::close(upstream);
        }
      }
      std::vector<std::size_t> closed;
      for (std::size_t k = 1; k < fds.size(); ++k) {
        if ((fds[k].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        const auto [a, b] = links_[(k - 1) / 2];
        const int from = fds[k].fd, to = from == a ? b : a;
        const ssize_t got = ::recv(from, buffer, sizeof buffer, 0);
        bool ok = got > 0;
        for (ssize_t sent = 0; ok && sent < got;) {
          const ssize_t n = ::send(to, buffer + sent, static_cast<std::size_t>(got - sent), MSG_NOSIGNAL);
          ok = n > 0;
          sent += n > 0 ? n : 0;
        }
        if (!ok) closed.push_back((k - 1) / 2);
      }
      for (auto it = closed.rbegin(); it != closed.rend(); ++it) {
        if (it + 1 != closed.rend() && *(it + 1) == *it) continue;
        ::close(links_[*it].first);
        ::close(links_[*it].second);
        links_.erase(links_.begin() + static_cast<std::ptrdiff_t>(*it));
      }
    }
  }

  std::uint16_t target_;
  std::uint16_t port_ = 0;
  int listener_ = -1;
  std::vector<std::pair<int, int>> links_;  // (client, upstream); the loop's thread only
  std::atomic<bool> frozen_{false}, cut_{false}, stop_{false};
  std::thread thread_;
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

// The store's own timeout stays at its default (300 s): only the group's (2 s) may bound
// what rank 1 waits for. Before failure reports used a bounded handle, rank 1's report
// waited for the store's 300 s (the test cuts the proxy after 20 s to end it).
TEST_CASE("a rank cut off from the store says so itself within the group's timeout", "[partition]") {
  cohort::tcp_store_options served;
  served.host = "127.0.0.1";
  served.port = 0;
  served.is_server = true;
  served.rank = 0;
  auto store0 = std::make_shared<cohort::tcp_store>(served);
  freezable_proxy proxy(store0->port());
  cohort::tcp_store_options through_proxy;
  through_proxy.host = "127.0.0.1";
  through_proxy.port = proxy.port();
  through_proxy.rank = 1;
  auto store1 = std::make_shared<cohort::tcp_store>(through_proxy);
  REQUIRE(store1->timeout() == cohort::store::default_timeout);

  std::mutex mutex;
  std::condition_variable changed;
  bool rank1_done = false;
  std::string seen;
  double took = 0;
  std::thread guard([&] {  // ends a report that would wait for the store's own timeout
    std::unique_lock lock(mutex);
    if (!changed.wait_for(lock, std::chrono::seconds(20), [&] { return rank1_done; })) proxy.cut();
  });
  cohort_test::run_ranks(2, [&](int rank) {
    cohort::gloo::options opts;
    opts.timeout = std::chrono::seconds(2);
    opts.on_async_error = cohort::async_error_handling::throw_on_next_call;
    cohort::process_group<cohort::gloo> pg(rank == 0 ? std::shared_ptr<cohort::store>(store0) : store1,
                                           cohort::launch_env::explicit_ranks(rank, 2), opts);
    pg.barrier().wait();
    if (rank == 0) {  // alive, connected to the store, but never issues the next call
      std::unique_lock lock(mutex);
      changed.wait_for(lock, std::chrono::seconds(40), [&] { return rank1_done; });
      return;
    }
    proxy.freeze();
    std::vector<float> data(16, 1.0f);
    const auto start = std::chrono::steady_clock::now();
    try {
      pg.all_reduce(std::span<float>(data)).wait();
    } catch (const cohort::error& failure) {
      seen = failure.what();
    }
    took = seconds_since(start);
    std::lock_guard lock(mutex);
    rank1_done = true;
    changed.notify_all();
  });
  guard.join();
  INFO("rank 1 saw after " << took << " s: " << seen);
  CHECK_THAT(seen, Contains("[rank 1]") &&
                       Contains("cannot reach rank 0's store at 127.0.0.1:" + std::to_string(proxy.port())));
  CHECK(took < 2.0 + 2.0 + 3.0);  // the group's timeout, the report's window, slack
}
