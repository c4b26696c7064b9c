// Rendezvous stores: tcp_store (client and server, c10d TCPStore wire protocol) and file_store.
// Multi-process cases fork while the test process is still single-threaded; children report
// through their exit status (and stderr), never through Catch2.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cohort/comm/detail/device_identity.hpp"
#include "cohort/detail/sha256.hpp"
#include "cohort/rendezvous/detail/hmac.hpp"
#include "cohort/rendezvous/detail/job_identity.hpp"
#include "cohort/rendezvous/file_store.hpp"
#include "cohort/rendezvous/tcp_store.hpp"
#include "cohort/rendezvous/tcp_store_server.hpp"
#include "support.hpp"
#if __has_include(<gloo/context.h>)
#include "cohort/comm/gloo.hpp"
#include "cohort/comm/process_group.hpp"
#endif

namespace {

using namespace std::chrono_literals;
namespace protocol = cohort::detail::tcp_store_protocol;

// --- processes -----------------------------------------------------------------------------

void expect(bool condition, const std::string& what) {
  if (!condition) throw std::runtime_error(what);
}

// Runs fn in a child process, which exits with fn's result (1 when it throws).
pid_t spawn(const std::function<int()>& fn) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    int code = 1;
    try {
      code = fn();
    } catch (const std::exception& failure) {
      std::fprintf(stderr, "child %d: %s\n", static_cast<int>(::getpid()), failure.what());
    }
    std::fflush(nullptr);
    ::_exit(code);
  }
  REQUIRE(pid > 0);
  return pid;
}

// The child's exit code; -1 when it had to be killed after `limit`, 128+signal when it died.
int wait_child(pid_t pid, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(2ms);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// --- sockets -------------------------------------------------------------------------------

// A port nobody listens on right now (bound once, then released).
using cohort_test::unused_port;

// A plain blocking socket to 127.0.0.1:port, reads bounded by 5 s.
struct raw_connection {
  int fd = -1;
  explicit raw_connection(std::uint16_t port) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
    timeval limit{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  }
  raw_connection(const raw_connection&) = delete;
  raw_connection& operator=(const raw_connection&) = delete;
  ~raw_connection() { ::close(fd); }

  void send(const cohort::bytes& data) const {
    // The server may already have closed: a failed send is fine, the read below tells.
    (void)::send(fd, data.data(), data.size(), MSG_NOSIGNAL);
  }
  // True when the server closed the connection (EOF or reset) within 5 s.
  bool closed_by_server() const {
    std::uint8_t sink[256];
    for (;;) {
      const ssize_t got = ::recv(fd, sink, sizeof(sink), 0);
      if (got == 0) return true;
      if (got < 0) return errno == ECONNRESET;
    }
  }
};

cohort::bytes validate_message() {
  cohort::bytes message;
  protocol::message_writer write(message);
  write.command(protocol::command::validate);
  write.u32(protocol::validation_magic);
  return message;
}

cohort::tcp_store_options client_of(std::uint16_t port, int rank = -1) {
  cohort::tcp_store_options options;
  options.port = port;
  options.rank = rank;
  options.timeout = 10s;
  options.connect_timeout = 10s;
  return options;
}

cohort::tcp_store_options hosting(std::chrono::milliseconds timeout = 10s) {
  cohort::tcp_store_options options;
  options.port = 0;
  options.is_server = true;
  options.timeout = timeout;
  return options;
}

// --- a common sequence, run on every store and compared with memory_store's results --------

std::vector<std::string> semantics_log(cohort::store& s) {
  using cohort::to_bytes;
  std::vector<std::string> log;
  auto record = [&](const std::string& what) { log.push_back(what); };
  const auto none = cohort::bytes{};
  s.set("plain", "v1");
  record(s.get_string("plain"));
  record(std::to_string(s.add("count", 5)));
  record(std::to_string(s.add("count", -7)));
  record(s.get_string("count"));
  const auto one = to_bytes("one");
  const auto two = to_bytes("two");
  const auto three = to_bytes("three");
  record(cohort::to_string(s.compare_set("cas", none, one)));    // absent, empty expected
  record(cohort::to_string(s.compare_set("cas", two, three)));   // wrong expected
  record(cohort::to_string(s.compare_set("cas", one, two)));     // right expected
  record(cohort::to_string(s.compare_set("absent", one, two)));  // absent, non-empty
  const std::vector<std::string> present{"plain", "cas"};
  const std::vector<std::string> partly{"plain", "absent"};
  record(s.check(present) ? "present" : "missing");
  record(s.check(partly) ? "present" : "missing");
  record(s.delete_key("plain") ? "deleted" : "not deleted");
  record(s.delete_key("plain") ? "deleted" : "not deleted");
  const std::vector<std::string> gone{"plain"};
  record(s.check(gone) ? "present" : "missing");
  cohort::bytes binary(256);
  for (int i = 0; i < 256; ++i) binary[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i);
  s.set("binary", std::span<const std::uint8_t>(binary));
  record(s.get("binary") == binary ? "binary intact" : "binary garbled");
  s.set("empty", std::span<const std::uint8_t>());
  record("empty:" + s.get_string("empty"));
  const std::vector<std::string> several{"cas", "binary", "empty", "count"};
  const auto values = s.multi_get(several);
  record(values.size() == several.size() && values[1] == binary
             ? "multi_get:" + cohort::to_string(values[0]) + "," + cohort::to_string(values[2]) + "," +
                   cohort::to_string(values[3])
             : "multi_get garbled");
  return log;
}

}  // namespace

// ===========================================================================================
// Protocol

TEST_CASE("store: the TCPStore request parser waits for whole messages and bounds lengths") {
  cohort::bytes message;
  protocol::message_writer write(message);
  write.command(protocol::command::compare_set);
  write.string("key");
  write.data(cohort::to_bytes("old"));
  write.data(cohort::to_bytes("new"));
  REQUIRE(message.size() == 1 + 3 * 8 + 3 + 3 + 3);

  protocol::request request;
  for (std::size_t prefix = 0; prefix < message.size(); ++prefix) {
    const auto result = protocol::parse_request(std::span<const std::uint8_t>(message.data(), prefix), request);
    INFO("prefix of " << prefix << " bytes");
    CHECK(result.status == protocol::parse_status::incomplete);
    CHECK(result.bytes > prefix);
    CHECK(result.bytes <= message.size());
  }
  message.push_back(0xAB);  // the start of the next request must not be taken
  const auto result = protocol::parse_request(message, request);
  REQUIRE(result.status == protocol::parse_status::complete);
  CHECK(result.bytes == message.size() - 1);
  CHECK(request.command == protocol::command::compare_set);
  REQUIRE(request.keys.size() == 1);
  CHECK(request.keys[0] == "key");
  REQUIRE(request.values.size() == 2);
  CHECK(cohort::to_string(request.values[0]) == "old");
  CHECK(cohort::to_string(request.values[1]) == "new");

  SECTION("an oversized key length is rejected before its bytes arrive") {
    cohort::bytes bad;
    protocol::message_writer w(bad);
    w.command(protocol::command::get);
    w.u64(protocol::max_key_bytes + 1);
    const auto r = protocol::parse_request(bad, request);
    CHECK(r.status == protocol::parse_status::malformed);
    CHECK_THAT(r.error, Catch::Contains(std::to_string(protocol::max_key_bytes + 1)));
  }
  SECTION("an oversized key count is rejected") {
    cohort::bytes bad;
    protocol::message_writer w(bad);
    w.command(protocol::command::wait);
    w.u64(std::uint64_t{1} << 60);
    CHECK(protocol::parse_request(bad, request).status == protocol::parse_status::malformed);
  }
  SECTION("an unknown command is rejected") {
    const cohort::bytes bad{200};
    CHECK(protocol::parse_request(bad, request).status == protocol::parse_status::malformed);
  }
}

// ===========================================================================================
// TCP store

TEST_CASE("store: tcp server and client processes set, get, add, wait and compare-set") {
  constexpr int clients = 4;
  int port_pipe[2];
  int stop_pipe[2];
  REQUIRE(::pipe(port_pipe) == 0);
  REQUIRE(::pipe(stop_pipe) == 0);

  const pid_t server = spawn([&] {
    ::close(stop_pipe[1]);
    cohort::tcp_store_server host("127.0.0.1", 0);
    const std::uint16_t port = host.port();
    expect(::write(port_pipe[1], &port, sizeof(port)) == sizeof(port), "port pipe");
    char sink;
    while (::read(stop_pipe[0], &sink, 1) > 0) {}  // serve until the parent closes the pipe
    return 0;
  });
  ::close(stop_pipe[0]);
  std::uint16_t port = 0;
  REQUIRE(::read(port_pipe[0], &port, sizeof(port)) == sizeof(port));
  REQUIRE(port != 0);

  std::vector<pid_t> children;
  for (int rank = 0; rank < clients; ++rank) {
    children.push_back(spawn([port, rank] {
      cohort::tcp_store s(client_of(port, rank));
      const std::string me = std::to_string(rank);
      s.set("rank/" + me, "value-" + me);
      s.add("counter", rank + 1);
      std::vector<std::string> everyone;
      for (int other = 0; other < clients; ++other) everyone.push_back("rank/" + std::to_string(other));
      s.wait(everyone);
      for (int other = 0; other < clients; ++other) {
        const std::string got = s.get_string("rank/" + std::to_string(other));
        expect(got == "value-" + std::to_string(other), "rank " + me + " read '" + got + "'");
      }
      // Election: the first compare-set on the absent key wins; everyone sees that winner.
      const auto winner = cohort::to_string(s.compare_set("leader", cohort::bytes{}, cohort::to_bytes("rank-" + me)));
      expect(winner.rfind("rank-", 0) == 0, "leader is '" + winner + "'");
      s.set("leader-seen/" + me, winner);
      std::vector<std::string> seen;
      for (int other = 0; other < clients; ++other) seen.push_back("leader-seen/" + std::to_string(other));
      s.wait(seen);
      for (const auto& key : seen) expect(s.get_string(key) == winner, key + " disagrees with " + winner);
      expect(s.get_string("counter") == std::to_string(clients * (clients + 1) / 2),
             "counter after every add: " + s.get_string("counter"));
      return 0;
    }));
  }
  for (const pid_t child : children) CHECK(wait_child(child, 20s) == 0);

  {
    cohort::tcp_store observer(client_of(port));
    CHECK(observer.get_string("counter") == std::to_string(clients * (clients + 1) / 2));
    // rank/*, leader-seen/* (4 each), counter, leader
    CHECK(observer.num_keys() == 2 * clients + 2);
  }
  ::close(stop_pipe[1]);
  CHECK(wait_child(server, 10s) == 0);
  ::close(port_pipe[0]);
  ::close(port_pipe[1]);
}

TEST_CASE("store: tcp store follows c10d semantics like memory_store") {
  cohort::memory_store reference;
  const auto expected = semantics_log(reference);
  cohort::tcp_store s(hosting());
  CHECK(semantics_log(s) == expected);
  CHECK(s.num_keys() == reference.num_keys());

  SECTION("extensions: append, multi_get, multi_set, ping") {
    s.append("log", cohort::to_bytes("ab"));
    s.append("log", cohort::to_bytes("cd"));
    CHECK(s.get_string("log") == "abcd");
    const std::vector<std::string> keys{"m1", "m2"};
    const std::vector<cohort::bytes> values{cohort::to_bytes("x"), cohort::to_bytes("yz")};
    s.multi_set(keys, values);
    CHECK(s.multi_get(keys) == values);
    s.ping();
  }
  SECTION("keys carry c10d's '/' prefix on the wire") {
    auto raw_options = client_of(s.port());
    raw_options.key_prefix = "";
    cohort::tcp_store raw(raw_options);
    s.set("shared", "via-prefix");
    CHECK(raw.get_string("/shared") == "via-prefix");
  }
  SECTION("a prefix_store over tcp keeps attempts apart") {
    auto inner = std::make_shared<cohort::tcp_store>(client_of(s.port()));
    cohort::prefix_store attempt0(inner, "/worker/attempt_0/");
    cohort::prefix_store attempt1(inner, "/worker/attempt_1/");
    attempt0.set("k", "zero");
    attempt1.set("k", "one");
    CHECK(attempt0.get_string("k") == "zero");
    CHECK(attempt1.get_string("k") == "one");
  }
  SECTION("ADD on a value that is not an integer closes that connection only") {
    s.set("text", "abc");
    cohort::tcp_store victim(client_of(s.port()));
    CHECK_THROWS_AS(victim.add("text", 1), cohort::error);
    CHECK_THROWS_WITH(victim.ping(), Catch::Contains("closed by an earlier failure"));
    CHECK(s.get_string("text") == "abc");
  }
}

TEST_CASE("store: tcp waits time out naming the key, the rank and the time") {
  auto options = hosting(300ms);
  options.rank = 3;
  cohort::tcp_store s(options);

  SECTION("get") {
    try {
      (void)s.get("never-set");
      FAIL("get of a key nobody sets returned");
    } catch (const cohort::timeout_error& failure) {
      const std::string text = failure.what();
      CHECK_THAT(text, Catch::Contains("'never-set'"));
      CHECK_THAT(text, Catch::Contains("rank 3"));
      CHECK_THAT(text, Catch::Contains("300 ms"));
      CHECK_THAT(text, Catch::Contains("store.get"));
    }
  }
  SECTION("wait names only the missing keys") {
    s.set("here", "1");
    try {
      s.wait({"here", "not-here"});
      FAIL("wait returned");
    } catch (const cohort::timeout_error& failure) {
      const std::string text = failure.what();
      CHECK_THAT(text, Catch::Contains("'not-here'"));
      CHECK_THAT(text, !Catch::Contains("'here'"));
    }
  }
  // The cancelled WAIT must leave the connection in step for what follows.
  s.set("after", "fine");
  CHECK(s.get_string("after") == "fine");
  s.ping();

  // A wait satisfied by another client returns, on the handle that timed out before.
  cohort::tcp_store other(client_of(s.port()));
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);
    other.set("late", "arrived");
  });
  s.set_timeout(5s);
  CHECK(s.get_string("late") == "arrived");
  setter.join();
}

// A group's store requests are bounded by the group's timeout: a server that stops answering
// (stopped here; cut off by a partition in test_multinode) ends a set or add through the
// group's prefix_store, or set_within/add_within, within that bound, not the store's own.
TEST_CASE("store: set and add within a bound end then when the server stops answering") {
  int port_pipe[2];
  REQUIRE(::pipe(port_pipe) == 0);
  const pid_t server = spawn([&] {
    cohort::tcp_store_server host("127.0.0.1", 0);
    const std::uint16_t port = host.port();
    expect(::write(port_pipe[1], &port, sizeof(port)) == sizeof(port), "port pipe");
    ::pause();  // serves until killed
    return 0;
  });
  std::uint16_t port = 0;
  REQUIRE(::read(port_pipe[0], &port, sizeof(port)) == sizeof(port));
  auto options = client_of(port, 2);
  options.timeout = 300s;  // the store's default: what a silent server held these calls for
  auto first = std::make_shared<cohort::tcp_store>(options);
  cohort::tcp_store second(options);
  first->set("before", "1");
  second.set("before", "2");
  REQUIRE(::kill(server, SIGSTOP) == 0);
  cohort::prefix_store group(first, "cohort/pg0/");
  group.set_timeout(400ms);
  // SET has no reply: it waits only while the value does not fit the sockets' buffers.
  const std::string large(std::size_t{64} << 20, 'x');
  auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(group.set("gloo/2", large),
                    Catch::Contains("store.set") &&
                        Catch::Contains("could not send to the store server at 127.0.0.1:") &&
                        Catch::Contains("within 400 ms") && Catch::Contains("rank 2"));
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(second.add_within("cohort/groups_created/2", 1, 300ms),
                    Catch::Contains("store.add") && Catch::Contains("within 300 ms"));
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  ::kill(server, SIGKILL);
  ::waitpid(server, nullptr, 0);
  ::close(port_pipe[0]);
  ::close(port_pipe[1]);
}

TEST_CASE("store: a tcp client started before its server connects once the server appears") {
  const std::uint16_t port = unused_port();
  const pid_t early = spawn([port] {
    auto options = client_of(port, 1);
    options.initial_backoff = 5ms;
    options.max_backoff = 100ms;
    cohort::tcp_store s(options);
    s.set("hello", "from an early client");
    expect(s.get_string("reply") == "welcome", "reply");
    return 0;
  });
  std::this_thread::sleep_for(300ms);  // the child is retrying by now
  auto options = client_of(port, 0);
  options.is_server = true;
  cohort::tcp_store s(options);
  CHECK(s.get_string("hello") == "from an early client");
  s.set("reply", "welcome");
  CHECK(wait_child(early, 15s) == 0);
}

TEST_CASE("store: a tcp client gives up connecting after its timeout, naming address and rank") {
  const std::uint16_t port = unused_port();
  auto options = client_of(port, 5);
  options.connect_timeout = 300ms;
  const auto start = std::chrono::steady_clock::now();
  try {
    cohort::tcp_store s(options);
    FAIL("connected to a port nobody listens on");
  } catch (const cohort::timeout_error& failure) {
    const std::string text = failure.what();
    CHECK_THAT(text, Catch::Contains("127.0.0.1:" + std::to_string(port)));
    CHECK_THAT(text, Catch::Contains("rank 5"));
    CHECK_THAT(text, Catch::Contains("300 ms"));
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);
}

TEST_CASE("store: the tcp server listens only on the address it is given") {
  cohort::tcp_store_server server("127.0.0.1", 0);
  sockaddr_in bound{};
  // Ask the kernel which address the listening socket has: connect and read our peer's name.
  raw_connection connection(server.port());
  socklen_t length = sizeof(bound);
  REQUIRE(::getpeername(connection.fd, reinterpret_cast<sockaddr*>(&bound), &length) == 0);
  CHECK(ntohl(bound.sin_addr.s_addr) == INADDR_LOOPBACK);
  // /proc/net/tcp lists the listener with its local address: 0100007F is 127.0.0.1.
  char wanted[32];
  std::snprintf(wanted, sizeof(wanted), "0100007F:%04X 00000000:0000 0A", server.port());
  std::FILE* table = std::fopen("/proc/net/tcp", "r");
  if (!table) cohort_test::skip("/proc/net/tcp is not readable here");
  bool listed_on_loopback = false;
  bool listed_on_any = false;
  char any[32];
  std::snprintf(any, sizeof(any), "00000000:%04X 00000000:0000 0A", server.port());
  char line[512];
  while (std::fgets(line, sizeof(line), table)) {
    if (std::strstr(line, wanted)) listed_on_loopback = true;
    if (std::strstr(line, any)) listed_on_any = true;
  }
  std::fclose(table);
  CHECK(listed_on_loopback);
  CHECK_FALSE(listed_on_any);
}

TEST_CASE("store: malformed and oversized messages close that connection, the server serves on") {
  cohort::tcp_store s(hosting());
  const auto& server = *s.server();
  s.set("before", "1");

  auto expect_rejected = [&](const cohort::bytes& message, const std::string& reason) {
    const std::size_t rejected = server.rejected_connections();
    raw_connection connection(s.port());
    connection.send(message);
    CHECK(connection.closed_by_server());
    CHECK(server.rejected_connections() == rejected + 1);
    CHECK_THAT(server.last_rejection(), Catch::Contains(reason));
    // Still serving: the long-lived client and a new one.
    CHECK(s.get_string("before") == "1");
    cohort::tcp_store fresh(client_of(s.port()));
    CHECK(fresh.get_string("before") == "1");
  };

  SECTION("not TCPStore at all") {
    const std::string http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    expect_rejected(cohort::bytes(http.begin(), http.end()), "unknown command");
  }
  SECTION("a wrong validation magic") {
    cohort::bytes message;
    protocol::message_writer write(message);
    write.command(protocol::command::validate);
    write.u32(0xDEADBEEF);
    expect_rejected(message, "magic");
  }
  SECTION("a request before VALIDATE") {
    cohort::bytes message;
    protocol::message_writer write(message);
    write.command(protocol::command::set);
    write.string("k");
    write.data(cohort::to_bytes("v"));
    expect_rejected(message, "not VALIDATE");
  }
  SECTION("an oversized key length") {
    auto message = validate_message();
    protocol::message_writer write(message);
    write.command(protocol::command::set);
    write.u64(std::uint64_t{1} << 40);
    expect_rejected(message, "exceeds");
  }
  SECTION("an oversized value length") {
    auto message = validate_message();
    protocol::message_writer write(message);
    write.command(protocol::command::set);
    write.string("k");
    write.u64(protocol::max_value_bytes + 1);
    expect_rejected(message, "exceeds");
  }
  SECTION("an absurd key count") {
    auto message = validate_message();
    protocol::message_writer write(message);
    write.command(protocol::command::wait);
    write.u64(~std::uint64_t{0});
    expect_rejected(message, "exceeds");
  }
  SECTION("an unknown command after VALIDATE") {
    auto message = validate_message();
    message.push_back(99);
    expect_rejected(message, "unknown command 99");
  }
  SECTION("half a message, then hanging up, is no rejection and no harm") {
    const std::size_t rejected = server.rejected_connections();
    {
      raw_connection connection(s.port());
      auto message = validate_message();
      protocol::message_writer write(message);
      write.command(protocol::command::set);
      write.string("half");
      write.u64(1000);
      message.resize(message.size() + 10);
      connection.send(message);
    }
    CHECK(s.get_string("before") == "1");
    CHECK_FALSE(s.check(std::vector<std::string>{"half"}));
    CHECK(server.rejected_connections() == rejected);
  }
  SECTION("a well-formed raw PING is echoed") {
    raw_connection connection(s.port());
    auto message = validate_message();
    protocol::message_writer write(message);
    write.command(protocol::command::ping);
    write.u32(0x12345678);
    connection.send(message);
    std::uint32_t echoed = 0;
    REQUIRE(::recv(connection.fd, &echoed, sizeof(echoed), MSG_WAITALL) == sizeof(echoed));
    CHECK(echoed == 0x12345678u);
  }
}

TEST_CASE("store: a tcp client refuses values over the limit before sending") {
  cohort::tcp_store s(hosting());
  const cohort::bytes huge(protocol::max_value_bytes + 1);
  CHECK_THROWS_WITH(s.set("huge", std::span<const std::uint8_t>(huge)), Catch::Contains("exceeds the store's limit"));
  s.ping();  // nothing was sent: the connection is fine
}

TEST_CASE("store: tcp store wait_for_workers counts clients in") {
  auto options = hosting(5s);
  options.num_workers = 3;
  const std::uint16_t port = unused_port();
  options.port = port;
  std::vector<pid_t> children;
  for (int rank = 1; rank < 3; ++rank) {
    children.push_back(spawn([port, rank] {
      auto client = client_of(port, rank);
      client.num_workers = 3;
      cohort::tcp_store s(client);
      return 0;
    }));
  }
  cohort::tcp_store s(options);  // returns once both children counted themselves in
  auto raw_options = client_of(port);
  raw_options.key_prefix = "";  // c10d's "init/" key has no '/' before it
  cohort::tcp_store raw(raw_options);
  CHECK(raw.get_string("init/") == "3");
  for (const pid_t child : children) CHECK(wait_child(child, 10s) == 0);
}

TEST_CASE("store: connect_store hosts on rank 0 and connects the others") {
  const std::uint16_t port = unused_port();
  const pid_t worker = spawn([port] {
    auto env = cohort::launch_env::explicit_ranks(1, 2);
    env.master_port = port;
    cohort::tcp_store_options options;
    options.timeout = 10s;
    options.connect_timeout = 10s;
    auto s = cohort::connect_store(env, options);
    s->set("from-1", "hi");
    expect(s->get_string("from-0") == "hello", "from-0");
    s->add("done", 1);
    return 0;
  });
  auto env = cohort::launch_env::explicit_ranks(0, 2);
  env.master_port = port;
  cohort::tcp_store_options options;
  options.timeout = 10s;
  auto s = cohort::connect_store(env, options);
  // The job's keys live under its id (rank 0 made one: the environment names none).
  auto* job = dynamic_cast<cohort::prefix_store*>(s.get());
  REQUIRE(job != nullptr);
  CHECK_THAT(job->prefix(), Catch::StartsWith("job/cohort-"));
  auto& served = dynamic_cast<cohort::tcp_store&>(*job->inner());
  CHECK(served.server() != nullptr);
  s->set("from-0", "hello");
  CHECK(s->get_string("from-1") == "hi");
  s->wait({"done"});
  CHECK(wait_child(worker, 15s) == 0);

  SECTION("under torchrun's agent store: a client under /worker/attempt_<n>/") {
    auto agent_env = cohort::launch_env::explicit_ranks(1, 2);
    agent_env.master_port = served.port();
    agent_env.use_agent_store = true;
    agent_env.restart_count = 2;
    auto agent = cohort::connect_store(agent_env, options);
    auto* prefixed = dynamic_cast<cohort::prefix_store*>(agent.get());
    REQUIRE(prefixed != nullptr);
    CHECK(prefixed->prefix() == "/worker/attempt_2/");
    agent->set("k", "v");
    CHECK(served.get_string("/worker/attempt_2/k") == "v");
  }
}

// ===========================================================================================
// Against PyTorch's TCPStore

namespace {

// Starts tests/torch_store_peer.py and returns it with its first line read. The peer checks
// for a PyTorch 2.x itself (one torch import, which takes seconds, instead of two) and says
// "SKIP <reason>" when there is none; then this test reports itself skipped.
std::FILE* start_peer(const std::string& arguments, std::string& first_line);

std::string peer_command(const std::string& arguments) {
  return std::string("python3 ") + COHORT_TEST_SOURCE_DIR + "/torch_store_peer.py " + arguments;
}

std::string read_line(std::FILE* stream) {
  char line[256] = {};
  if (!std::fgets(line, sizeof(line), stream)) return {};
  std::string text(line);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  return text;
}

std::FILE* start_peer(const std::string& arguments, std::string& first_line) {
  std::FILE* peer = ::popen(peer_command(arguments).c_str(), "r");
  REQUIRE(peer != nullptr);
  first_line = read_line(peer);
  if (first_line.rfind("SKIP ", 0) == 0) {
    ::pclose(peer);
    cohort_test::skip(first_line.substr(5));
  }
  if (first_line.empty()) {
    const int status = ::pclose(peer);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 127)
      cohort_test::skip("no python3 on PATH, so no PyTorch TCPStore to test against");
    FAIL("tests/torch_store_peer.py said nothing (exit status " << status << ")");
  }
  return peer;
}

}  // namespace

TEST_CASE("store: our tcp client against PyTorch's TCPStore server (libuv and classic)") {
  std::string ports;
  std::FILE* peer = start_peer("master", ports);
  INFO("peer said: " << ports);
  unsigned libuv_port = 0;
  unsigned classic_port = 0;
  REQUIRE(std::sscanf(ports.c_str(), "PORTS %u %u", &libuv_port, &classic_port) == 2);

  for (const unsigned port : {libuv_port, classic_port}) {
    INFO("TCPStore server on port " << port);
    {
      // PyTorch's server checks no token: a rank that has one is told so, at once.
      auto with_token = client_of(static_cast<std::uint16_t>(port));
      with_token.token = "not-for-pytorch";
      CHECK_THROWS_WITH(cohort::tcp_store(with_token), Catch::Contains("it checks no token"));
    }
    cohort::tcp_store s(client_of(static_cast<std::uint16_t>(port)));
    CHECK(s.get_string("py/x") == "from-python");
    CHECK(s.add("counter", 5) == 7);
    const std::vector<std::string> both{"py/x", "counter"};
    const auto before = s.requests_sent();
    CHECK(s.multi_get(both) == std::vector<cohort::bytes>{cohort::to_bytes("from-python"), cohort::to_bytes("7")});
    CHECK(s.requests_sent() - before == 2);  // WAIT, MULTI_GET
    CHECK(cohort::to_string(s.compare_set("cas", cohort::bytes{}, cohort::to_bytes("one"))) == "one");
    CHECK(cohort::to_string(s.compare_set("cas", cohort::to_bytes("zz"), cohort::to_bytes("two"))) == "one");
    CHECK(s.check(std::vector<std::string>{"py/x"}));
    CHECK_FALSE(s.check(std::vector<std::string>{"py/x", "nope"}));
    cohort::bytes binary(256);
    for (int i = 0; i < 256; ++i) binary[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(i);
    s.set("cpp/binary", std::span<const std::uint8_t>(binary));
    s.set("cpp/deleted", "x");
    CHECK(s.delete_key("cpp/deleted"));
    CHECK_FALSE(s.delete_key("cpp/deleted"));
    CHECK(s.num_keys() >= 4);
    // A wait that times out must leave the torch server and our connection in step.
    CHECK_THROWS_AS(s.wait(std::vector<std::string>{"never"}, 200ms), cohort::timeout_error);
    s.ping();
    s.set("cpp/a", "hello");
    CHECK(s.get_string("py/late") == "late");  // the peer sets it once it has seen cpp/a
    s.set("cpp/done", "1");
  }
  std::string verdict;
  for (std::string line; !(line = read_line(peer)).empty();) verdict = line;
  const int status = ::pclose(peer);
  CHECK(verdict == "OK");
  CHECK(status == 0);
}

TEST_CASE("store: PyTorch's TCPStore client against our tcp server") {
  cohort::tcp_store s(hosting(20s));
  s.set("cpp/x", "from-cpp");
  s.set("n", "4");
  std::string ready;
  std::FILE* peer = start_peer("client " + std::to_string(s.port()), ready);
  REQUIRE(ready == "READY");
  s.wait({"py/a"});
  s.set("cpp/late", "late");
  s.wait({"py/done"});
  CHECK(s.get_string("after-timeout") == "1");
  CHECK(s.get_string("cas") == "w");
  CHECK(s.get_string("app") == "abcd");
  CHECK(s.get_string("m2") == "b");
  CHECK(s.get_string("n") == "7");
  CHECK_FALSE(s.check(std::vector<std::string>{"py/a"}));  // the peer deleted it
  std::string verdict;
  for (std::string line; !(line = read_line(peer)).empty();) verdict = line;
  const int status = ::pclose(peer);
  CHECK(verdict == "OK");
  CHECK(status == 0);
  CHECK(s.server()->rejected_connections() == 0);
}

namespace {

// PyTorch 1.x lives in Debian's python3 (python3-torch), often not the python3 on PATH.
std::string torch1_peer(const std::string& arguments) {
  const char* chosen = std::getenv("COHORT_TEST_TORCH1_PYTHON");
  const std::string python =
      chosen ? chosen : (::access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3");
  return python + " " + COHORT_TEST_SOURCE_DIR + "/torch1_store_peer.py " + arguments;
}

}  // namespace

TEST_CASE("store: a PyTorch 1.x TCPStore server is named as another protocol, not as a wrong address") {
  // The peer serves until its stdin closes: keep a pipe to it open for the test's length.
  int to_peer[2];
  REQUIRE(::pipe(to_peer) == 0);
  ::fcntl(to_peer[1], F_SETFD, FD_CLOEXEC);  // only the read end goes to the peer
  const std::string command = torch1_peer("server") + " < /dev/fd/" + std::to_string(to_peer[0]);
  std::FILE* peer = ::popen(command.c_str(), "r");
  REQUIRE(peer != nullptr);
  ::close(to_peer[0]);
  const std::string first = read_line(peer);
  if (first.rfind("SKIP ", 0) == 0 || first.empty()) {
    ::close(to_peer[1]);
    ::pclose(peer);
    cohort_test::skip(first.empty() ? "no python3 to run tests/torch1_store_peer.py" : first.substr(5));
  }
  unsigned port = 0;
  REQUIRE(std::sscanf(first.c_str(), "PORT %u", &port) == 1);
  auto options = client_of(static_cast<std::uint16_t>(port));
  options.connect_timeout = 30s;
  const auto started = std::chrono::steady_clock::now();
  std::string text;
  try {
    cohort::tcp_store s(options);
  } catch (const cohort::error& failure) {
    text = failure.what();
  }
  const auto took = std::chrono::steady_clock::now() - started;
  ::close(to_peer[1]);
  ::pclose(peer);
  INFO(text);
  CHECK_THAT(text, Catch::Matchers::Contains("another c10d store protocol"));
  CHECK_THAT(text, Catch::Matchers::Contains("PyTorch 2.x"));
  CHECK_THAT(text, !Catch::Matchers::Contains("check MASTER_ADDR"));
  CHECK(took < 15s);  // an answer, not a connect timeout
}

TEST_CASE("store: a PyTorch 1.x client is refused and the server says it speaks another protocol") {
  cohort::tcp_store s(hosting(20s));
  std::FILE* peer = ::popen(torch1_peer("client " + std::to_string(s.port())).c_str(), "r");
  REQUIRE(peer != nullptr);
  const std::string result = read_line(peer);
  ::pclose(peer);
  if (result.rfind("SKIP ", 0) == 0 || result.empty())
    cohort_test::skip(result.empty() ? "no python3 to run tests/torch1_store_peer.py" : result.substr(5));
  INFO("the 1.x client said: " << result);
  CHECK(result != "RESULT ok");
  CHECK(s.server()->rejected_connections() >= 1);
  CHECK_THAT(s.server()->last_rejection(), Catch::Matchers::Contains("not VALIDATE"));
  CHECK_THAT(s.server()->last_rejection(), Catch::Matchers::Contains("another c10d store protocol"));
}

// ===========================================================================================
// Hostile clients, the token, batched reads (SECURITY.md)

namespace {

std::string hex(std::span<const std::uint8_t> digest) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string text;
  for (const std::uint8_t byte : digest) {
    text += digits[byte >> 4];
    text += digits[byte & 15];
  }
  return text;
}

std::span<const std::uint8_t> as_span(std::string_view text) {
  return {reinterpret_cast<const std::uint8_t*>(text.data()), text.size()};
}

// Sanitizers keep freed memory in quarantine and shadow every byte: resident size says
// nothing about the server's bound there, so only the release build checks it.
constexpr bool resident_size_is_meaningful = !cohort_test::sanitized;

long peak_resident_kib() {
  std::FILE* status = std::fopen("/proc/self/status", "r");
  if (!status) return -1;
  char line[256];
  long kib = -1;
  while (std::fgets(line, sizeof(line), status))
    if (std::sscanf(line, "VmHWM: %ld kB", &kib) == 1) break;
  std::fclose(status);
  return kib;
}

// A tcp_store_server in a child process (so its memory and descriptors are its own), asked
// for its numbers through a pipe.
class server_process {
 public:
  struct report {
    std::size_t rejected = 0;
    std::uint64_t held = 0;
    std::size_t open = 0;
    std::size_t max_connections = 0;
    long peak_kib = -1;
    std::string last_rejection;
  };

  explicit server_process(const cohort::tcp_store_server_options& options, rlim_t descriptor_limit = 0) {
    int down[2];
    int up[2];
    REQUIRE(::pipe(down) == 0);
    REQUIRE(::pipe(up) == 0);
    pid_ = spawn([&] {
      ::close(down[1]);
      ::close(up[0]);
      if (descriptor_limit > 0) {
        const rlimit limit{descriptor_limit, descriptor_limit};
        expect(::setrlimit(RLIMIT_NOFILE, &limit) == 0, "setrlimit");
      }
      cohort::tcp_store_server server("127.0.0.1", 0, 0, options);
      const std::uint16_t port = server.port();
      expect(::write(up[1], &port, sizeof port) == sizeof port, "port pipe");
      char command = 0;
      while (::read(down[0], &command, 1) == 1) {
        const std::string text = std::to_string(server.rejected_connections()) + " " +
                                 std::to_string(server.held_bytes()) + " " + std::to_string(server.open_connections()) +
                                 " " + std::to_string(server.max_connections()) + " " +
                                 std::to_string(peak_resident_kib()) + " " + server.last_rejection() + "\n";
        expect(::write(up[1], text.data(), text.size()) == static_cast<ssize_t>(text.size()), "report pipe");
      }
      return 0;
    });
    ::close(down[0]);
    ::close(up[1]);
    to_child_ = down[1];
    from_child_ = ::fdopen(up[0], "r");
    REQUIRE(std::fread(&port_, sizeof port_, 1, from_child_) == 1);
  }
  server_process(const server_process&) = delete;
  server_process& operator=(const server_process&) = delete;
  ~server_process() {
    if (to_child_ >= 0) ::close(to_child_);
    if (from_child_) std::fclose(from_child_);
    if (pid_ > 0) wait_child(pid_, 10s);
  }

  std::uint16_t port() const { return port_; }

  report ask() {
    REQUIRE(::write(to_child_, "?", 1) == 1);
    char line[4096] = {};
    REQUIRE(std::fgets(line, sizeof line, from_child_) != nullptr);
    report out;
    unsigned long long held = 0;
    int consumed = 0;
    REQUIRE(std::sscanf(line, "%zu %llu %zu %zu %ld %n", &out.rejected, &held, &out.open, &out.max_connections,
                        &out.peak_kib, &consumed) >= 5);
    out.held = held;
    out.last_rejection = line + consumed;
    return out;
  }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  std::FILE* from_child_ = nullptr;
  std::uint16_t port_ = 0;
};

// The key pattern of a start, on `ranks` processes: every rank publishes its address, reads
// everyone's in one batched read, rank 0 publishes a group id the others wait for, and every
// rank counts itself done. Returns how long the slowest rank took; every rank must succeed
// within `limit` (its store timeout too).
std::chrono::milliseconds rendezvous(std::uint16_t port, const std::string& run, int ranks,
                                     std::chrono::milliseconds limit, const std::string& token = {}) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<pid_t> children;
  for (int rank = 0; rank < ranks; ++rank) {
    children.push_back(spawn([=] {
      auto options = client_of(port, rank);
      options.timeout = limit;
      options.connect_timeout = limit;
      options.token = token;
      cohort::tcp_store s(options);
      const std::string base = run + "/";
      s.set(base + "addr/" + std::to_string(rank), "10.0.0." + std::to_string(rank) + ":2950" + std::to_string(rank));
      std::vector<std::string> keys;
      for (int r = 0; r < ranks; ++r) keys.push_back(base + "addr/" + std::to_string(r));
      const auto values = s.multi_get(keys);
      for (int r = 0; r < ranks; ++r)
        expect(cohort::to_string(values[static_cast<std::size_t>(r)]) ==
                   "10.0.0." + std::to_string(r) + ":2950" + std::to_string(r),
               "rank " + std::to_string(rank) + " read a wrong address for rank " + std::to_string(r));
      if (rank == 0) s.set(base + "group", "id-" + run);
      expect(s.get_string(base + "group") == "id-" + run, "group id");
      s.add(base + "done", 1);
      return 0;
    }));
  }
  bool all_ok = true;
  for (const pid_t child : children) all_ok = wait_child(child, limit + 5s) == 0 && all_ok;
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  INFO("rendezvous '" << run << "' of " << ranks << " ranks took " << took.count() << " ms");
  CHECK(all_ok);
  CHECK(took < limit);
  return took;
}

cohort::bytes get_request(std::string_view key) {
  cohort::bytes message;
  protocol::message_writer write(message);
  write.command(protocol::command::get);
  write.string(key);
  return message;
}

void send_all_blocking(int fd, std::span<const std::uint8_t> data) {
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t sent = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (sent <= 0) return;  // the server closed it: what the test then checks
    done += static_cast<std::size_t>(sent);
  }
}

}  // namespace

TEST_CASE("store: SHA-256 and HMAC-SHA256 match FIPS 180 and RFC 4231") {
  using cohort::detail::hmac_sha256;
  using cohort::detail::sha256;
  CHECK(hex(sha256::of(as_span(""))) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(hex(sha256::of(as_span("abc"))) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  CHECK(hex(sha256::of(as_span(two_blocks))) == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million(1000000, 'a');
  CHECK(hex(sha256::of(as_span(million))) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Fed in pieces of every size from 1 to 130 bytes, the digest is the same.
  for (std::size_t piece = 1; piece <= 130; piece += 7) {
    sha256 hash;
    for (std::size_t at = 0; at < two_blocks.size(); at += piece)
      hash.update(std::string_view(two_blocks).substr(at, piece));
    CHECK(hex(hash.finish()) == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  }

  const std::vector<std::uint8_t> key1(20, 0x0b);
  CHECK(hex(hmac_sha256(key1, {as_span("Hi There")})) ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  CHECK(hex(hmac_sha256(as_span("Jefe"), {as_span("what do ya want "), as_span("for nothing?")})) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  const std::vector<std::uint8_t> key3(20, 0xaa);
  const std::vector<std::uint8_t> data3(50, 0xdd);
  CHECK(hex(hmac_sha256(key3, {data3})) == "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  std::vector<std::uint8_t> key4;
  for (std::uint8_t b = 1; b <= 25; ++b) key4.push_back(b);
  const std::vector<std::uint8_t> data4(50, 0xcd);
  CHECK(hex(hmac_sha256(key4, {data4})) == "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  const std::vector<std::uint8_t> long_key(131, 0xaa);
  CHECK(hex(hmac_sha256(long_key, {as_span("Test Using Larger Than Block-Size Key - Hash Key First")})) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  CHECK(hex(hmac_sha256(long_key, {as_span("This is a test using a larger than block-size key and a larger than "
                                           "block-size data. The key needs to be hashed before being used by the "
                                           "HMAC algorithm.")})) ==
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");

  CHECK(cohort::detail::equal_in_constant_time(key3, key3));
  CHECK_FALSE(cohort::detail::equal_in_constant_time(key3, key1));
  CHECK_FALSE(cohort::detail::equal_in_constant_time(key3, data3));
}

TEST_CASE("store: multi_get costs two requests whatever the number of keys, and names what is missing") {
  cohort::tcp_store s(hosting(2s));
  std::vector<std::string> keys;
  std::vector<cohort::bytes> expected;
  for (int r = 0; r < 256; ++r) {
    keys.push_back("rank/" + std::to_string(r));
    expected.push_back(cohort::to_bytes("address of " + std::to_string(r)));
    s.set(keys.back(), std::span<const std::uint8_t>(expected.back()));
  }
  cohort::tcp_store reader(client_of(s.port()));
  for (const std::size_t count : {std::size_t{1}, std::size_t{16}, std::size_t{256}}) {
    const auto before = reader.requests_sent();
    const auto values = reader.multi_get(std::span<const std::string>(keys).first(count));
    CHECK(reader.requests_sent() - before == 2);  // WAIT, MULTI_GET
    CHECK(values ==
          std::vector<cohort::bytes>(expected.begin(), expected.begin() + static_cast<std::ptrdiff_t>(count)));
  }
  // Key by key, the same read costs two requests per key (c10d's get is WAIT + GET).
  const auto before = reader.requests_sent();
  for (std::size_t r = 0; r < 16; ++r) (void)reader.get(keys[r]);
  CHECK(reader.requests_sent() - before == 32);

  const std::vector<std::string> partly{"rank/0", "rank/never"};
  CHECK_THROWS_WITH(reader.multi_get(partly, 200ms),
                    Catch::Contains("'/rank/never'") || Catch::Contains("'rank/never'"));
  CHECK_THROWS_WITH(reader.multi_get(partly, 200ms), !Catch::Contains("'rank/0'"));
  reader.ping();  // the connection is still in step

  auto memory = std::make_shared<cohort::memory_store>();
  cohort::prefix_store view(memory, "p/");
  view.set("a", "1");
  view.set("b", "2");
  const std::vector<std::string> ab{"a", "b"};
  CHECK(view.multi_get(ab) == std::vector<cohort::bytes>{cohort::to_bytes("1"), cohort::to_bytes("2")});
  CHECK(memory->get_string("p/b") == "2");
  const std::vector<std::string> missing{"a", "z"};
  CHECK_THROWS_WITH(view.multi_get(missing, 50ms), Catch::Contains("'p/z'"));
}

TEST_CASE("store: a token admits the ranks that know it and refuses everyone else before any key") {
  const std::string token = "correct horse battery staple";
  auto host = hosting(5s);
  host.token = token;
  cohort::tcp_store s(host);
  CHECK(s.authenticated());
  const auto& server = *s.server();
  s.set("secret", "for the job only");

  // Four ranks that know the token meet; each publishes and reads differently.
  rendezvous(s.port(), "with-token", 4, 10s, token);

  auto quick = [&](const std::string& with) {
    auto options = client_of(s.port(), 7);
    options.token = with;
    options.connect_timeout = 3s;
    return options;
  };
  SECTION("a rank without the token is told the server requires one") {
    const auto started = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(cohort::tcp_store(quick("")),
                      Catch::Contains("requires a token (COHORT_STORE_TOKEN)") && Catch::Contains("rank 7"));
    CHECK(std::chrono::steady_clock::now() - started < 2s);  // an answer, not a connect timeout
    CHECK_THAT(server.last_rejection(), Catch::Contains("without proving the store token"));
  }
  SECTION("a rank with another token is refused, and the server did not prove itself to it") {
    CHECK_THROWS_WITH(cohort::tcp_store(quick("another token")), Catch::Contains("could not prove that it knows"));
  }
  SECTION("a c10d client is closed at its first command byte, before any key is read") {
    const std::size_t rejected = server.rejected_connections();
    for (const auto command : {protocol::command::set, protocol::command::get, protocol::command::add}) {
      raw_connection connection(s.port());
      auto message = validate_message();
      protocol::message_writer write(message);
      write.command(command);
      write.string("secret");
      if (command == protocol::command::set) write.data(cohort::to_bytes("overwritten"));
      if (command == protocol::command::add) write.i64(1);
      connection.send(message);
      CHECK(connection.closed_by_server());  // no reply byte came first
    }
    CHECK(server.rejected_connections() == rejected + 3);
    CHECK(s.get_string("secret") == "for the job only");
  }
  SECTION("a forged proof is refused") {
    raw_connection connection(s.port());
    auto message = validate_message();
    protocol::message_writer write(message);
    write.command(protocol::command::auth_hello);
    write.u8(protocol::auth_version);
    write.raw_bytes(std::vector<std::uint8_t>(32, 7));
    connection.send(message);
    std::uint8_t challenge[65];
    REQUIRE(::recv(connection.fd, challenge, sizeof challenge, MSG_WAITALL) == sizeof challenge);
    CHECK(challenge[0] == 0);
    cohort::bytes proof;
    protocol::message_writer answer(proof);
    answer.command(protocol::command::auth_proof);
    answer.raw_bytes(std::span<const std::uint8_t>(challenge + 33, 32));  // the server's own proof, replayed
    connection.send(proof);
    std::uint8_t verdict = 0;
    CHECK(::recv(connection.fd, &verdict, 1, 0) == 1);
    CHECK(verdict == static_cast<std::uint8_t>(protocol::auth_reply::refused));
    CHECK(connection.closed_by_server());
    CHECK_THAT(server.last_rejection(), Catch::Contains("token proof is wrong"));
  }
  SECTION("a rank with a token meets a server without one") {
    cohort::tcp_store open_server(hosting());
    auto options = client_of(open_server.port());
    options.token = token;
    CHECK_THROWS_WITH(cohort::tcp_store(options), Catch::Contains("was started without a token"));
  }
  SECTION("the server's limits come with the handshake: the client refuses an oversized value itself") {
    auto small = hosting();
    small.token = token;
    small.server.max_value_bytes = 1024;
    cohort::tcp_store limited(small);
    const cohort::bytes big(2048);
    CHECK_THROWS_WITH(limited.set("big", std::span<const std::uint8_t>(big)),
                      Catch::Contains("exceeds the store's limit of 1024"));
    limited.ping();  // nothing was sent
  }
}

TEST_CASE("store: the token never crosses the wire, and the environment supplies it") {
  // A listener that records what a client with a token sends.
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  REQUIRE(::listen(listener, 4) == 0);
  socklen_t length = sizeof(address);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
  const std::string token = "TOKEN-THAT-MUST-NOT-LEAK";
  std::thread client([&] {
    auto options = client_of(ntohs(address.sin_port));
    options.token = token;
    options.connect_timeout = 300ms;
    try {
      cohort::tcp_store s(options);
    } catch (const cohort::error&) {}
  });
  const int connection = ::accept(listener, nullptr, nullptr);
  REQUIRE(connection >= 0);
  timeval limit{2, 0};
  ::setsockopt(connection, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  std::string seen(1 + 4 + 1 + 1 + 32, '\0');  // VALIDATE, then AUTH_HELLO
  const ssize_t got = ::recv(connection, seen.data(), seen.size(), MSG_WAITALL);
  pollfd more{connection, POLLIN, 0};
  const int another = ::poll(&more, 1, 100);  // and nothing more before a reply
  ::close(connection);
  ::close(listener);
  client.join();
  REQUIRE(got == static_cast<ssize_t>(seen.size()));
  CHECK(another == 0);
  CHECK(static_cast<std::uint8_t>(seen[5]) == 0xC0);
  CHECK(seen.find(token) == std::string::npos);

  SECTION("COHORT_STORE_TOKEN, or a file") {
    ::setenv("COHORT_STORE_TOKEN", "from-env", 1);
    CHECK(cohort::store_token_from_environment() == "from-env");
    const std::string file = "/tmp/cohort-token-" + std::to_string(::getpid());
    std::FILE* out = std::fopen(file.c_str(), "w");
    REQUIRE(out != nullptr);
    std::fputs("from-file\n", out);
    std::fclose(out);
    ::setenv("COHORT_STORE_TOKEN_FILE", file.c_str(), 1);
    CHECK_THROWS_WITH(cohort::store_token_from_environment(), Catch::Contains("both"));
    ::unsetenv("COHORT_STORE_TOKEN");
    CHECK(cohort::store_token_from_environment() == "from-file");
    out = std::fopen(file.c_str(), "w");
    std::fclose(out);
    CHECK_THROWS_WITH(cohort::store_token_from_environment(), Catch::Contains("is empty"));
    std::remove(file.c_str());
    CHECK_THROWS_WITH(cohort::store_token_from_environment(), Catch::Contains("cannot read"));
    ::unsetenv("COHORT_STORE_TOKEN_FILE");
    CHECK(cohort::store_token_from_environment().empty());
  }
  SECTION("torchrun's agent store checks no token: connect_store says so instead of failing later") {
    auto env = cohort::launch_env::explicit_ranks(1, 2);
    env.use_agent_store = true;
    cohort::tcp_store_options options;
    options.token = "t";
    CHECK_THROWS_WITH(cohort::connect_store(env, options),
                      Catch::Contains("PyTorch's TCPStore, which checks no token"));
  }
}

TEST_CASE("store: a value shared by GETs on connections that never read costs one copy and the rendezvous goes on") {
  // The attack: one 64 MiB value, 24 GETs on 3 connections that never read. The
  // server is configured to accept such a value; its default refuses it outright.
  cohort::tcp_store_server_options options;
  options.max_value_bytes = std::uint64_t{64} << 20;
  options.max_memory_bytes = std::uint64_t{160} << 20;
  server_process server(options);
  {
    cohort::tcp_store writer(client_of(server.port()));
    const cohort::bytes big(std::size_t{64} << 20, 0x5a);
    writer.set("big", std::span<const std::uint8_t>(big));
    CHECK(writer.get("big", 10s).size() == big.size());  // this client reads: served in full
  }
  std::vector<std::unique_ptr<raw_connection>> silent;
  for (int c = 0; c < 3; ++c) {
    silent.push_back(std::make_unique<raw_connection>(server.port()));
    auto message = validate_message();
    for (int g = 0; g < 8; ++g) {
      const auto get = get_request("/big");
      message.insert(message.end(), get.begin(), get.end());
    }
    silent.back()->send(message);
  }
  std::this_thread::sleep_for(200ms);
  const auto attacked = server.ask();
  INFO("server holds " << attacked.held << " bytes with 24 GETs of a 64 MiB value unread");
  CHECK(attacked.held < (std::uint64_t{66} << 20));  // the value once, no copy per reply
  rendezvous(server.port(), "beside-unread-gets", 4, 5s);
  const auto after = server.ask();
  if (resident_size_is_meaningful) {
    INFO("server peak resident " << after.peak_kib << " KiB");
    CHECK(after.peak_kib > 0);
    CHECK(after.peak_kib <= 256 * 1024);
  }
  // The default limits refuse the 64 MiB value itself, at its length.
  cohort::tcp_store defaults(hosting());
  cohort::tcp_store writer(client_of(defaults.port()));
  const cohort::bytes big(std::size_t{64} << 20, 0x5a);
  try {
    writer.set("big", std::span<const std::uint8_t>(big));  // c10d's SET has no reply: the send or the next call tells
    writer.ping();
    FAIL("a 64 MiB value was accepted under the default limits");
  } catch (const cohort::error& failure) {
    CHECK_THAT(failure.what(), Catch::Contains("max_value_bytes"));
  }
  CHECK_THAT(defaults.server()->last_rejection(), Catch::Contains("exceeds the limit of 16777216"));
}

TEST_CASE("store: idle connections past a low descriptor limit do not lock the ranks out") {
  // The attack: 400 idle connections to a server whose process may open 300.
  cohort::tcp_store_server_options options;
  options.reserved_connections = 4;
  server_process server(options, 300);
  std::vector<std::unique_ptr<raw_connection>> idle;
  for (int c = 0; c < 400; ++c) idle.push_back(std::make_unique<raw_connection>(server.port()));
  std::this_thread::sleep_for(100ms);
  const auto flooded = server.ask();
  INFO("connection limit " << flooded.max_connections << ", open " << flooded.open);
  CHECK(flooded.max_connections < 300);
  CHECK(flooded.open <= flooded.max_connections);
  rendezvous(server.port(), "past-idle-flood", 4, 5s);
  const auto after = server.ask();
  CHECK(after.rejected >= 400 - after.max_connections);
  CHECK_THAT(after.last_rejection, Catch::Contains("had not proved itself"));
}

TEST_CASE("store: half-sent and oversized requests are refused or timed out, memory stays bounded") {
  cohort::tcp_store_server_options options;
  options.idle_timeout = 1s;
  options.handshake_timeout = 1s;
  server_process server(options);  // default limits: 16 MiB values, 128 MiB in all
  auto announce = [&](protocol::command command, std::uint64_t announced, std::size_t sent) {
    auto connection = std::make_unique<raw_connection>(server.port());
    auto message = validate_message();
    protocol::message_writer write(message);
    write.command(command);
    write.string("victim");
    write.u64(announced);
    message.resize(message.size() + sent, 0x11);
    send_all_blocking(connection->fd, message);
    return connection;
  };
  // Announcing 256 MiB (a SET, and COMPARE_SET's expected value) is refused at the length.
  for (const auto command : {protocol::command::set, protocol::command::compare_set}) {
    const auto connection = announce(command, std::uint64_t{256} << 20, 0);
    CHECK(connection->closed_by_server());
  }
  CHECK_THAT(server.ask().last_rejection, Catch::Contains("exceeds the limit of 16777216"));
  // Twelve truncated 15 MiB SETs with 12 MiB sent each: 144 MiB announced, more than the budget.
  std::vector<std::unique_ptr<raw_connection>> truncated;
  for (int c = 0; c < 12; ++c) truncated.push_back(announce(protocol::command::set, 15 << 20, 12 << 20));
  truncated.push_back(announce(protocol::command::set, 100, 10));        // a small one, stalled
  truncated.push_back(std::make_unique<raw_connection>(server.port()));  // never says anything
  const auto loaded = server.ask();
  INFO("holding " << loaded.held << " bytes of half-sent requests; last refusal: " << loaded.last_rejection);
  CHECK(loaded.held <= options.max_memory_bytes);
  CHECK(loaded.rejected >= 3);  // the budget turned some of the twelve away
  rendezvous(server.port(), "beside-truncated", 4, 5s);
  // Past the idle timeout every half-sent request, and the silent connection, is closed.
  for (const auto& connection : truncated) CHECK(connection->closed_by_server());
  auto after = server.ask();
  for (int tries = 0; tries < 100 && after.held >= (std::uint64_t{1} << 20); ++tries) {
    std::this_thread::sleep_for(20ms);  // the server's numbers are published once per round
    after = server.ask();
  }
  CHECK(after.held < (std::uint64_t{1} << 20));
  if (resident_size_is_meaningful) {
    INFO("server peak resident " << after.peak_kib << " KiB");
    CHECK(after.peak_kib <= 256 * 1024);
  }
}

TEST_CASE("store: at its connection limit the server turns newcomers away and the client says so") {
  auto options = hosting(2s);
  options.server.max_connections = 3;
  cohort::tcp_store s(options);
  cohort::tcp_store second(client_of(s.port()));
  cohort::tcp_store third(client_of(s.port()));
  s.set("a", "1");  // every connection has proved itself: none may be closed for a newcomer
  second.set("b", "2");
  third.set("c", "3");
  auto late = client_of(s.port(), 3);
  late.connect_timeout = 500ms;
  CHECK_THROWS_WITH(cohort::tcp_store(late), Catch::Contains("connection limit") && Catch::Contains("rank 3"));
  CHECK(second.get_string("a") == "1");  // the served ones are unaffected
}

TEST_CASE("a rank drives its local rank's GPU among those it sees, one per process included") {
  using cohort::detail::choose_device;
  // Every GPU visible (torchrun's default): local rank r drives GPU r.
  CHECK(choose_device(-1, 0, 8, nullptr).device == 0);
  CHECK(choose_device(-1, 5, 8, nullptr).device == 5);
  // One GPU per process through CUDA_VISIBLE_DEVICES (Slurm's --gpus-per-task, some
  // launchers): local rank 3 sees one device, its own, at index 0. This threw before.
  const auto own = choose_device(-1, 3, 1, "3");
  CHECK(own.error.empty());
  CHECK(own.device == 0);
  // Two GPUs per process: local rank 1 drives the second it sees.
  CHECK(choose_device(-1, 1, 2, "2,3").device == 1);
  // An explicit device wins, and is checked against what is visible.
  CHECK(choose_device(2, 0, 4, nullptr).device == 2);
  const auto beyond = choose_device(4, 0, 4, "0,1,2,3");
  CHECK(beyond.device == -1);
  CHECK_THAT(beyond.error, Catch::Contains("options.device 4") && Catch::Contains("only 4 GPU(s) visible") &&
                               Catch::Contains("CUDA_VISIBLE_DEVICES=0,1,2,3"));
  const auto none = choose_device(-1, 0, 0, "");
  CHECK(none.device == -1);
  CHECK_THAT(none.error, Catch::Contains("no GPU is visible"));
  // More local ranks than GPUs: the modulo puts two on one GPU, which the duplicate check
  // then refuses, naming both ranks and these counts.
  CHECK(choose_device(-1, 2, 2, nullptr).device == 0);
  CHECK(cohort::detail::describe_device_counts(2, 3, 2, nullptr) ==
        "local rank 2 of 3 sees 2 GPU(s) (CUDA_VISIBLE_DEVICES unset)");
}

TEST_CASE("store: values cohort reads back are checked before use") {
  using cohort::detail::well_formed_device_identity;
  CHECK(well_formed_device_identity("node-7|0000:3B:00.0"));
  CHECK(well_formed_device_identity("gpu01.cluster|00000001:c1:1f.7"));
  CHECK_FALSE(well_formed_device_identity("node-7"));
  CHECK_FALSE(well_formed_device_identity("|0000:3B:00.0"));
  CHECK_FALSE(well_formed_device_identity("node 7|0000:3B:00.0"));
  CHECK_FALSE(well_formed_device_identity("node-7|0000:3B:00"));
  CHECK_FALSE(well_formed_device_identity("node-7|0000:3B:0G.0"));
  CHECK_FALSE(well_formed_device_identity(std::string("node-7|0000:3B:00.0\0", 20)));

  int fields[3] = {};
  CHECK(cohort::detail::parse_int_fields("-1,20,300", ',', fields));
  CHECK((fields[0] == -1 && fields[1] == 20 && fields[2] == 300));
  for (const char* bad : {"1,2", "1,2,3,4", "a,2,3", "1,,3", " 1,2,3", "1,2,3 ", "99999999999,1,1"})
    CHECK_FALSE(cohort::detail::parse_int_fields(bad, ',', fields));

  const auto failure = cohort::detail::malformed_store_value(2, "split", "cohort/pg1/split0/1",
                                                             std::string_view("\x01garbage\xff"), "x");
  CHECK_THAT(failure.what(), Catch::Contains("key 'cohort/pg1/split0/1' holds malformed data written by someone else"));
  CHECK_THAT(failure.what(), Catch::Contains("\\x01garbage\\xff"));
  CHECK_THAT(failure.what(), Catch::Contains("COHORT_STORE_TOKEN"));

#if __has_include(<gloo/context.h>)
  SECTION("garbage under a rank's split entry is named, on the rank that reads it") {
    auto shared = std::make_shared<cohort::memory_store>();
    cohort_test::run_ranks(2, [&](int rank) {
      cohort::gloo::options opts;
      opts.timeout = 10s;
      cohort::process_group<cohort::gloo> pg(shared, cohort::launch_env::explicit_ranks(rank, 2), opts);
      if (rank == 1) {
        // Not rank 1's own entry: what an outsider writes under its key.
        shared->set("cohort/pg1/split0/1", "garbage");
        return;
      }
      RANK_CHECK_THROWS(cohort::error, pg.split(0, 0),
                        "key 'cohort/pg1/split0/1' holds malformed data written by someone else: 'garbage'");
    });
  }
#endif
}

// ===========================================================================================
// File store

namespace {

struct temporary_directory {
  std::filesystem::path path;
  temporary_directory() {
    std::string pattern = (std::filesystem::temp_directory_path() / "cohort-store-XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  ~temporary_directory() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

}  // namespace

TEST_CASE("store: file store follows c10d semantics like memory_store") {
  temporary_directory dir;
  cohort::memory_store reference;
  const auto expected = semantics_log(reference);
  cohort::file_store s(dir.path, "run");
  CHECK(semantics_log(s) == expected);
  CHECK(s.num_keys() == reference.num_keys());
}

TEST_CASE("store: file store never reads the files of a run with another id") {
  temporary_directory dir;
  {
    cohort::file_store earlier(dir.path, "run-1");
    earlier.set("x", "stale");
    earlier.add("counter", 41);
  }
  cohort::file_store now(dir.path, "run-2", 7);
  now.set_timeout(200ms);
  CHECK_FALSE(now.check(std::vector<std::string>{"x"}));
  CHECK(now.num_keys() == 0);
  CHECK(now.add("counter", 1) == 1);
  try {
    (void)now.get("x");
    FAIL("read a key of the earlier run");
  } catch (const cohort::timeout_error& failure) {
    CHECK_THAT(failure.what(), Catch::Contains("'x'"));
    CHECK_THAT(failure.what(), Catch::Contains("rank 7"));
  }
  // The earlier run's data is still there under its own id (isolation, not loss).
  cohort::file_store again(dir.path, "run-1");
  CHECK(again.get_string("x") == "stale");
  CHECK_THROWS_AS(cohort::file_store(dir.path, ""), cohort::error);
}

TEST_CASE("store: file store add is atomic across processes") {
  temporary_directory dir;
  constexpr int children_count = 4;
  constexpr int adds_each = 40;
  std::vector<pid_t> children;
  for (int rank = 0; rank < children_count; ++rank) {
    children.push_back(spawn([&dir, rank] {
      cohort::file_store s(dir.path, "run", rank);
      s.set_timeout(10s);
      std::string returned;
      for (int i = 0; i < adds_each; ++i) returned += std::to_string(s.add("counter", 1)) + " ";
      s.set("returned/" + std::to_string(rank), returned);
      return 0;
    }));
  }
  for (const pid_t child : children) CHECK(wait_child(child, 30s) == 0);
  cohort::file_store s(dir.path, "run");
  CHECK(s.get_string("counter") == std::to_string(children_count * adds_each));
  // Every add returned a different value: no two read-modify-writes overlapped.
  std::multiset<int> seen;
  for (int rank = 0; rank < children_count; ++rank) {
    std::istringstream values(s.get_string("returned/" + std::to_string(rank)));
    for (int value; values >> value;) seen.insert(value);
  }
  REQUIRE(seen.size() == static_cast<std::size_t>(children_count * adds_each));
  int expected = 1;
  for (const int value : seen) CHECK(value == expected++);
}

TEST_CASE("store: file store readers never see a partly written value") {
  temporary_directory dir;
  constexpr std::size_t size = 256 * 1024;
  const pid_t writer = spawn([&dir] {
    cohort::file_store s(dir.path, "run");
    for (int round = 0; round < 60; ++round) s.set("big", std::string(size, round % 2 ? 'B' : 'A'));
    s.set("writer-done", "1");
    return 0;
  });
  cohort::file_store s(dir.path, "run");
  s.set_timeout(20s);
  int reads = 0;
  while (!s.check(std::vector<std::string>{"writer-done"})) {
    if (!s.check(std::vector<std::string>{"big"})) continue;
    const std::string value = s.get_string("big");
    ++reads;
    REQUIRE(value.size() == size);
    REQUIRE(value.find_first_not_of(value.front()) == std::string::npos);
  }
  CHECK(wait_child(writer, 30s) == 0);
  INFO("reads while writing: " << reads);
  CHECK(reads > 0);
}

TEST_CASE("store: file store keys may hold any bytes") {
  temporary_directory dir;
  cohort::file_store s(dir.path, "run/with spaces");
  const std::string long_a(1000, 'a');
  const std::vector<std::string> keys{"",  ".hidden",    "..",         "a/b c",     "%41",
                                      "A", long_a + "1", long_a + "2", "tab\there", std::string("\0z", 2)};
  for (std::size_t i = 0; i < keys.size(); ++i) s.set(keys[i], "value-" + std::to_string(i));
  for (std::size_t i = 0; i < keys.size(); ++i) CHECK(s.get_string(keys[i]) == "value-" + std::to_string(i));
  CHECK(s.num_keys() == static_cast<std::int64_t>(keys.size()));
  CHECK(std::filesystem::is_directory(s.path()));
  CHECK(std::filesystem::path(s.path()).parent_path() == dir.path);
}

TEST_CASE("store: file store waits time out naming the missing keys") {
  temporary_directory dir;
  cohort::file_store s(dir.path, "run", 2);
  s.set("here", "1");
  const auto start = std::chrono::steady_clock::now();
  try {
    s.wait(std::vector<std::string>{"here", "not-here"}, 200ms);
    FAIL("wait returned");
  } catch (const cohort::timeout_error& failure) {
    const std::string text = failure.what();
    CHECK_THAT(text, Catch::Contains("'not-here'"));
    CHECK_THAT(text, !Catch::Contains("'here'"));
    CHECK_THAT(text, Catch::Contains("200 ms"));
    CHECK_THAT(text, Catch::Contains("rank 2"));
  }
  CHECK(std::chrono::steady_clock::now() - start >= 200ms);
}

// ===========================================================================================
// One job per store: connect_store's job identity

namespace {

cohort::launch_env rank_of_job(int rank, int world, std::uint16_t port, const std::string& job) {
  auto env = cohort::launch_env::explicit_ranks(rank, world);
  env.master_port = port;
  env.run_id = job;
  return env;
}

cohort::tcp_store_options short_waits() {
  cohort::tcp_store_options options;
  options.timeout = 10s;
  options.connect_timeout = 10s;
  return options;
}

// A program that is no store on a port: it answers "HTTP/1.1 400 Bad Request" to whatever
// arrives (`at_once`), or, as a server that reads whole request lines, only once the client
// ends its request (half-closes), and then closes.
class http_like_server {
 public:
  // silent: accepts and never reads, answers or closes (a hung service on the port).
  explicit http_like_server(bool at_once, bool silent = false) : at_once_(at_once), silent_(silent) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
    REQUIRE(::listen(fd_, 16) == 0);
    socklen_t length = sizeof(address);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  http_like_server(const http_like_server&) = delete;
  http_like_server& operator=(const http_like_server&) = delete;
  ~http_like_server() {
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
    for (const int client : held_) ::close(client);
  }
  std::uint16_t port() const { return port_; }

 private:
  void serve() {
    for (;;) {
      const int client = ::accept(fd_, nullptr, nullptr);
      if (client < 0) return;
      if (silent_) {
        held_.push_back(client);
        continue;
      }
      char sink[512];
      if (at_once_) {
        (void)::recv(client, sink, sizeof sink, 0);
      } else {
        while (::recv(client, sink, sizeof sink, 0) > 0) {}  // until the request ends
      }
      const std::string reply = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n";
      (void)::send(client, reply.data(), reply.size(), MSG_NOSIGNAL);
      ::close(client);
    }
  }
  bool at_once_;
  bool silent_;
  std::vector<int> held_;
  int fd_ = -1;
  std::uint16_t port_ = 0;
  std::thread thread_;
};

}  // namespace

TEST_CASE("store: a rank of another job is refused when it connects, naming both jobs") {
  const std::uint16_t port = unused_port();
  auto owner = cohort::connect_store(rank_of_job(0, 2, port, "job-B"), short_waits());
  std::string refused;
  const auto started = std::chrono::steady_clock::now();
  try {
    cohort::connect_store(rank_of_job(1, 2, port, "job-A"), short_waits());
  } catch (const cohort::error& failure) {
    refused = failure.what();
  }
  INFO(refused);
  CHECK(std::chrono::steady_clock::now() - started < 2s);
  CHECK_THAT(refused, Catch::Contains("rank 1 of job job-A") && Catch::Contains("which serves job job-B") &&
                          Catch::Contains("give each job its own MASTER_PORT"));
  // Refused before it wrote anything: the job's own rank 1 joins as if nothing happened.
  auto member = cohort::connect_store(rank_of_job(1, 2, port, "job-B"), short_waits());
  member->set("from-1", "hi");
  CHECK(owner->get_string("from-1") == "hi");
  CHECK(dynamic_cast<cohort::prefix_store&>(*owner).prefix() == "job/job-B/");

  SECTION("a rank 0 of another job names the job that holds the port") {
    CHECK_THROWS_WITH(cohort::connect_store(rank_of_job(0, 2, port, "job-A"), short_waits()),
                      Catch::Contains("is in use, held by rank 0 of another cohort job: job job-B") &&
                          Catch::Contains("pick another MASTER_PORT"));
  }
  SECTION("a rank without a job id is refused by a job with one, and says why") {
    CHECK_THROWS_WITH(cohort::connect_store(rank_of_job(1, 2, port, ""), short_waits()),
                      Catch::Contains("rank 1 of job (no id)") && Catch::Contains("which serves job job-B") &&
                          Catch::Contains("a job without an id") && Catch::Contains("never joins one with an id"));
  }
  SECTION("a rank of job-B started twice is the second claimant: it fails, and so does job-B's first group") {
    CHECK_THROWS_WITH(cohort::connect_store(rank_of_job(1, 2, port, "job-B"), short_waits()),
                      Catch::Contains("job collision") && Catch::Contains("second process to claim rank 1") &&
                          Catch::Contains("the first: rank 1 of job job-B"));
    CHECK_THROWS_WITH(cohort::detail::check_not_collided(*owner, 0, "the job's first group"),
                      Catch::Contains("job collision") && Catch::Contains("two processes claimed rank 1") &&
                          Catch::Contains("before its first collective"));
  }
  SECTION("a rank started with another world size is refused") {
    CHECK_THROWS_WITH(cohort::connect_store(rank_of_job(2, 4, port, "job-B"), short_waits()),
                      Catch::Contains("was started with a world of 4") && Catch::Contains("world of 2"));
  }
}

TEST_CASE("store: a job launched without an id lives under its store host's nonce, and a second claimant stops it") {
  const std::uint16_t port = unused_port();
  auto owner = cohort::connect_store(rank_of_job(0, 2, port, ""), short_waits());
  auto member = cohort::connect_store(rank_of_job(1, 2, port, ""), short_waits());
  const auto& prefix = dynamic_cast<cohort::prefix_store&>(*owner).prefix();
  CHECK_THAT(prefix, Catch::StartsWith("job/cohort-"));
  CHECK(dynamic_cast<cohort::prefix_store&>(*member).prefix() == prefix);
  CHECK_NOTHROW(cohort::detail::check_not_collided(*owner, 0, "the job's first group"));

  // Another job without an id is told apart by nothing: its ranks claim ranks already taken.
  SECTION("a second rank 1 fails naming the collision, and the job it met is marked") {
    CHECK_THROWS_WITH(cohort::connect_store(rank_of_job(1, 2, port, ""), short_waits()),
                      Catch::Contains("job collision") && Catch::Contains("second process to claim rank 1") &&
                          Catch::Contains("job without an id, cohort-"));
  }
  SECTION("a second rank 0 finds the port in use, and the job it met is marked") {
    CHECK_THROWS_WITH(cohort::connect_store(rank_of_job(0, 2, port, ""), short_waits()),
                      Catch::Contains("is in use, held by rank 0 of job without an id, cohort-") &&
                          Catch::Contains("marked collided"));
  }
  for (auto* rank : {owner.get(), member.get()})
    CHECK_THROWS_WITH(cohort::detail::check_not_collided(*rank, 0, "the job's first group"),
                      Catch::Contains("job collision") && Catch::Contains("before its first collective"));
}

// A port held by another program: the other ranks said "never answered" after a minute (an
// HTTP server had replied 400) and guessed at old PyTorch versions. Now they say what answered,
// with the real elapsed time, within seconds.
TEST_CASE("store: a program that is no store on the port is named by what it answered") {
  for (const bool at_once : {true, false}) {
    INFO((at_once ? "it answers at once" : "it answers when the request ends"));
    http_like_server other(at_once);
    auto options = client_of(other.port());
    options.connect_timeout = 60s;
    std::string text;
    const auto started = std::chrono::steady_clock::now();
    try {
      cohort::tcp_store s(options);
    } catch (const cohort::error& failure) {
      text = failure.what();
    }
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    INFO(text);
    CHECK(took < 8.0);
    CHECK_THAT(text, Catch::Contains("answered cohort's handshake with 'HTTP/1.1 400 Bad Request") &&
                         Catch::Contains("not the TCPStore protocol") && !Catch::Contains("300 s") &&
                         !Catch::Contains("never answered") && !Catch::Contains("PyTorch before 2.0"));
    const auto after = text.find("(after ");
    REQUIRE(after != std::string::npos);
    CHECK(std::stod(text.substr(after + 7)) <= took);
  }
}

// A listener that accepts and never answers cost every rank but rank 0 its whole connect
// timeout (61 s); now a rank says what holds the port within seconds, even when its connect
// wait follows a long job timeout.
TEST_CASE("store: a silent listener on the port is named within seconds") {
  http_like_server silent(true, true);
  auto env = cohort::launch_env::explicit_ranks(1, 2);
  env.master_port = silent.port();
  cohort::tcp_store_options options;
  options.timeout = 120s;
  std::string text;
  const auto started = std::chrono::steady_clock::now();
  try {
    cohort::connect_store(env, options);
  } catch (const cohort::error& failure) {
    text = failure.what();
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  INFO(text);
  CHECK(took < 15.0);
  CHECK_THAT(text, Catch::Contains("something listens on 127.0.0.1:" + std::to_string(silent.port())) &&
                       Catch::Contains("does not speak the store protocol"));
}

namespace {

// While it lives, what this process writes to stderr goes to `path` (what a rank prints).
class stderr_to_file {
 public:
  explicit stderr_to_file(const std::string& path) : saved_(::dup(STDERR_FILENO)) {
    std::fflush(stderr);
    const int file = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    ::dup2(file, STDERR_FILENO);
    ::close(file);
  }
  stderr_to_file(const stderr_to_file&) = delete;
  stderr_to_file& operator=(const stderr_to_file&) = delete;
  ~stderr_to_file() {
    std::fflush(stderr);
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
  }

 private:
  int saved_;
};

}  // namespace

// The other nodes gave up on a store host later than the connect limit (60 s) while the job
// waited 600 s: now a rank waits for the store host as long as the store's timeout.
TEST_CASE("store: a rank waits for a late store host as long as the job's timeout, not the connect limit") {
  const std::uint16_t port = unused_port();
  const pid_t late_host = spawn([port] {
    std::this_thread::sleep_for(3s);
    auto env = cohort::launch_env::explicit_ranks(0, 2);
    env.master_port = port;
    cohort::tcp_store_options options;
    options.timeout = 15s;
    auto s = cohort::connect_store(env, options);
    s->set("from-0", "late");
    s->wait({"done"});
    return 0;
  });
  auto env = cohort::launch_env::explicit_ranks(1, 2);
  env.master_port = port;
  cohort::tcp_store_options options;
  options.timeout = 15s;
  options.connect_timeout = 1s;  // the limit a rank used to give up at, shorter than the job's wait
  options.progress_interval = 1s;
  const std::string log =
      (std::filesystem::temp_directory_path() / ("cohort_late_host_" + std::to_string(::getpid()))).string();
  std::shared_ptr<cohort::store> s;
  {
    const stderr_to_file lines(log);
    s = cohort::connect_store(env, options);
  }
  // The waiting rank says what it waits for meanwhile (every second here, 30 s by default).
  std::ifstream printed(log);
  const std::string said((std::istreambuf_iterator<char>(printed)), std::istreambuf_iterator<char>());
  std::filesystem::remove(log);
  INFO(said);
  CHECK_THAT(said, Catch::Contains(
                       "tcp_store: still connecting to the store server at 127.0.0.1:" + std::to_string(port) + " (") &&
                       Catch::Contains(" s of 15 s, "));
  CHECK(s->get_string("from-0") == "late");
  s->add("done", 1);
  CHECK(wait_child(late_host, 15s) == 0);
}

// The Gloo backend asks its store where other hosts reached this one through the store's own
// virtual (it compiles no TCP store): cohort's server answers below any prefix, a store that
// cannot tell answers nothing, however the key came to be written.
TEST_CASE("store: where other hosts reached the store is read below any prefix, only from cohort's server") {
  const std::uint16_t port = unused_port();
  auto owner = cohort::connect_store(rank_of_job(0, 1, port, "job-reach"), short_waits());
  const std::string key(cohort::detail::tcp_store_protocol::store_reached_key);
  auto& job_prefix = dynamic_cast<cohort::prefix_store&>(*owner);
  CHECK(owner->reached_from_other_hosts(100ms).empty());  // only loopback connections so far
  // The server writes the key itself on its first connection from another host; written here.
  job_prefix.inner()->set(key, std::string_view("10.0.0.7"));
  cohort::prefix_store group(owner, "cohort/pg1/");
  CHECK(group.reached_from_other_hosts(1s) == "10.0.0.7");
  CHECK(owner->reached_from_other_hosts(1s) == "10.0.0.7");

  auto memory = std::make_shared<cohort::memory_store>();
  memory->set(key, std::string_view("10.0.0.7"));
  CHECK(cohort::prefix_store(memory, "cohort/pg1/").reached_from_other_hosts(1s).empty());
}
