// GPU link topology on synthetic boxes: classification of each pair, NVLink counting through
// NVSwitch, the nvidia-smi-like matrix, and the advice. The probe itself runs wherever cohort
// is built with CUDA; without a device it must say so instead of failing.

#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "cohort/tools/topology.hpp"

using cohort::link_class;
using cohort::link_evidence;
using cohort::pcie_ancestor;

namespace {

std::vector<cohort::gpu_info> gpus(std::size_t count, const std::string& name, int major, int gen, int width,
                                   std::size_t per_socket) {
  std::vector<cohort::gpu_info> out(count);
  for (std::size_t i = 0; i < count; ++i) {
    out[i].name = name;
    char id[16];
    std::snprintf(id, sizeof id, "0000:%02x:00.0", unsigned(0x10 + 0x10 * i));
    out[i].pci_bus_id = id;
    out[i].numa_node = static_cast<int>(i / per_socket);
    out[i].pcie_generation = out[i].pcie_max_generation = gen;
    out[i].pcie_width = out[i].pcie_max_width = width;
    out[i].compute_major = major;
  }
  return out;
}

// An 8x H100 HGX board: every pair over NVSwitch with 18 links.
cohort::topology hgx_h100() {
  return cohort::make_topology(gpus(8, "NVIDIA H100 80GB HBM3", 9, 5, 16, 4), [](std::size_t, std::size_t) {
    link_evidence e;
    e.nvlink_count = 18;
    e.ancestor = pcie_ancestor::system;  // PCIe would be SYS for half the pairs; NVLink wins
    return e;
  });
}

// 8 PCIe GPUs, two sockets, two switches per socket: {0,1} {2,3} on socket 0, {4,5} {6,7} on 1.
cohort::topology pcie_box() {
  return cohort::make_topology(gpus(8, "NVIDIA L40S", 8, 4, 16, 4), [](std::size_t a, std::size_t b) {
    link_evidence e;
    e.p2p_supported = true;
    if (a / 4 != b / 4)
      e.ancestor = pcie_ancestor::system;
    else if (a / 2 != b / 2)
      e.ancestor = pcie_ancestor::host_bridge;
    else
      e.ancestor = pcie_ancestor::single_switch;
    return e;
  });
}

std::string expected_row(const std::string& head, const std::vector<std::string>& cells, const std::string& numa) {
  auto pad = [](std::string text) {
    text.resize(std::max<std::size_t>(text.size(), 8), ' ');
    return text;
  };
  std::string row = pad(head);
  for (const auto& cell : cells) row += pad(" " + cell);
  return row + numa + "\n";
}

bool any_contains(const std::vector<std::string>& lines, const std::string& needle) {
  for (const auto& line : lines)
    if (line.find(needle) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("topology: classification of one pair from the evidence") {
  link_evidence e;
  e.same_gpu = true;
  CHECK(cohort::classify_link(e) == link_class::self);
  e = {};
  e.nvlink_count = 4;
  e.ancestor = pcie_ancestor::system;
  CHECK(cohort::classify_link(e) == link_class::nvlink);
  e.nvlink_count = 0;
  CHECK(cohort::classify_link(e) == link_class::cross_socket);
  e.ancestor = pcie_ancestor::single_switch;
  CHECK(cohort::classify_link(e) == link_class::pcie_same_switch);
  e.ancestor = pcie_ancestor::same_board;
  CHECK(cohort::classify_link(e) == link_class::pcie_same_switch);
  e.ancestor = pcie_ancestor::multiple_switches;
  CHECK(cohort::classify_link(e) == link_class::pcie_across_switches);
  e.ancestor = pcie_ancestor::host_bridge;
  CHECK(cohort::classify_link(e) == link_class::pcie_host_bridge);
  e.ancestor = pcie_ancestor::numa_node;
  CHECK(cohort::classify_link(e) == link_class::pcie_same_numa);
  // Without NVML: NUMA nodes and peer access only.
  e = {};
  e.numa_a = 0;
  e.numa_b = 1;
  e.p2p_supported = true;
  CHECK(cohort::classify_link(e) == link_class::cross_socket);
  e.numa_b = 0;
  CHECK(cohort::classify_link(e) == link_class::pcie_host_bridge);
  e.p2p_supported = false;
  CHECK(cohort::classify_link(e) == link_class::pcie_same_numa);
  CHECK(cohort::classify_link(link_evidence{}) == link_class::none);
}

TEST_CASE("topology: NVML ancestor levels and labels") {
  CHECK(cohort::pcie_ancestor_from_nvml_level(0) == pcie_ancestor::same_board);
  CHECK(cohort::pcie_ancestor_from_nvml_level(10) == pcie_ancestor::single_switch);
  CHECK(cohort::pcie_ancestor_from_nvml_level(20) == pcie_ancestor::multiple_switches);
  CHECK(cohort::pcie_ancestor_from_nvml_level(30) == pcie_ancestor::host_bridge);
  CHECK(cohort::pcie_ancestor_from_nvml_level(40) == pcie_ancestor::numa_node);
  CHECK(cohort::pcie_ancestor_from_nvml_level(50) == pcie_ancestor::system);
  CHECK(cohort::pcie_ancestor_from_nvml_level(7) == pcie_ancestor::unknown);
  CHECK(std::string(cohort::label(link_class::pcie_same_switch)) == "PIX");
  CHECK(std::string(cohort::label(link_class::pcie_across_switches)) == "PXB");
  CHECK(std::string(cohort::label(link_class::pcie_host_bridge)) == "PHB");
  CHECK(std::string(cohort::label(link_class::pcie_same_numa)) == "NODE");
  CHECK(std::string(cohort::label(link_class::cross_socket)) == "SYS");
  CHECK(cohort::nvlink_version_for_compute_capability(9, 0) == 4);
  CHECK(cohort::nvlink_version_for_compute_capability(8, 0) == 3);
  CHECK(cohort::nvlink_version_for_compute_capability(7, 5) == 0);  // Turing: no NVLink generation to name
}

TEST_CASE("topology: PCI bus ids from CUDA and NVML normalise to one spelling") {
  CHECK(cohort::normalize_pci_bus_id("0000:18:00.0") == "0000:18:00.0");
  CHECK(cohort::normalize_pci_bus_id("00000000:18:00.0") == "0000:18:00.0");
  CHECK(cohort::normalize_pci_bus_id("0000:B7:00.1") == "0000:b7:00.1");
  CHECK(cohort::normalize_pci_bus_id("1a:00.0") == "0000:1a:00.0");
  CHECK(cohort::normalize_pci_bus_id(std::string("0000:18:00.0\0\0", 14)) == "0000:18:00.0");
  CHECK(cohort::normalize_pci_bus_id("") == "");
  CHECK(cohort::normalize_pci_bus_id("not a bus id") == "");
  CHECK(cohort::normalize_pci_bus_id("0000:18:00") == "");
  CHECK(cohort::normalize_pci_bus_id("0000:18:40.0") == "");  // device > 31
}

TEST_CASE("topology: NVLink counts through NVSwitch and direct bridges") {
  const std::vector<std::string> ids = {"0000:10:00.0", "0000:20:00.0", "0000:30:00.0", "0000:40:00.0"};
  SECTION("every GPU on switches: each pair gets the lesser link count") {
    std::vector<std::vector<std::string>> ends(4, std::vector<std::string>(18, "00000000:00:00.0"));
    ends[3].resize(12);  // one GPU with fewer links up
    const auto counts = cohort::nvlink_pair_counts(ids, ends);
    CHECK(counts[0][1] == 18);
    CHECK(counts[1][0] == 18);
    CHECK(counts[0][3] == 12);
    CHECK(counts[3][2] == 12);
    CHECK(counts[2][2] == 0);
  }
  SECTION("bridged pairs 0-1 and 2-3, four links each, seen from either side") {
    std::vector<std::vector<std::string>> ends(4);
    ends[0].assign(4, "00000000:20:00.0");
    ends[1].assign(4, "00000000:10:00.0");
    ends[2].assign(4, "0000:40:00.0");
    // GPU 3 did not report its side: the count from GPU 2 still holds for the pair.
    const auto counts = cohort::nvlink_pair_counts(ids, ends);
    CHECK(counts[0][1] == 4);
    CHECK(counts[1][0] == 4);
    CHECK(counts[2][3] == 4);
    CHECK(counts[3][2] == 4);
    CHECK(counts[0][2] == 0);
    CHECK(counts[1][3] == 0);
  }
  CHECK_THROWS_AS(cohort::nvlink_pair_counts(ids, {}), cohort::error);
}

TEST_CASE("topology: an 8-GPU NVSwitch box prints NV18 everywhere and advises NVLink") {
  const auto topo = hgx_h100();
  REQUIRE(topo.size() == 8);
  CHECK(topo.link(0, 7).kind == link_class::nvlink);
  CHECK(topo.link(0, 7).nvlink_count == 18);
  CHECK(topo.link(0, 7).nvlink_version == 4);
  CHECK(topo.link(3, 3).kind == link_class::self);
  CHECK_THROWS_AS(topo.link(0, 8), cohort::error);

  const std::string text = cohort::format_topology_matrix(topo);
  std::vector<std::string> header_cells;
  for (int i = 0; i < 8; ++i) header_cells.push_back("GPU" + std::to_string(i));
  std::string header(8, ' ');
  for (const auto& cell : header_cells) header += cell + std::string(8 - cell.size(), ' ');
  CHECK(text.rfind(header + "NUMA Affinity\n", 0) == 0);
  std::vector<std::string> row0(8, "NV18");
  row0[0] = "X";
  CHECK_THAT(text, Catch::Contains(expected_row("GPU0", row0, "0")));
  std::vector<std::string> row5(8, "NV18");
  row5[5] = "X";
  CHECK_THAT(text, Catch::Contains(expected_row("GPU5", row5, "1")));
  CHECK_THAT(text, Catch::Contains("NV#  = a bonded set of # NVLinks"));
  CHECK_THAT(text, Catch::Contains("GPU7: NVIDIA H100 80GB HBM3, 0000:80:00.0, PCIe Gen5 x16, NUMA 1, NVLink 4"));

  const auto lines = cohort::advice(topo);
  CHECK(any_contains(lines, "GPUs 0-7 are all joined by NVLink (at least NV18)"));
  CHECK_FALSE(any_contains(lines, "PCIe only"));
  CHECK_FALSE(any_contains(lines, "SYS"));  // NVLink pairs never count as cross-socket traffic
  CHECK(cohort::suggested_link_preset(topo) == "nvlink-h100");
}

TEST_CASE("topology: a PCIe box with two switches per socket and two sockets") {
  auto topo = pcie_box();
  CHECK(topo.link(0, 1).kind == link_class::pcie_same_switch);
  CHECK(topo.link(0, 2).kind == link_class::pcie_host_bridge);
  CHECK(topo.link(0, 4).kind == link_class::cross_socket);
  CHECK(topo.link(6, 7).kind == link_class::pcie_same_switch);
  CHECK(topo.link(5, 2).kind == link_class::cross_socket);
  CHECK(topo.link(0, 1).p2p_supported);

  const std::string text = cohort::format_topology_matrix(topo);
  CHECK_THAT(text, Catch::Contains(expected_row("GPU0", {"X", "PIX", "PHB", "PHB", "SYS", "SYS", "SYS", "SYS"}, "0")));
  CHECK_THAT(text, Catch::Contains(expected_row("GPU6", {"SYS", "SYS", "SYS", "SYS", "PHB", "PHB", "X", "PIX"}, "1")));
  CHECK_THAT(text, Catch::Contains("GPU3: NVIDIA L40S, 0000:40:00.0, PCIe Gen4 x16, NUMA 0\n"));

  auto lines = cohort::advice(topo);
  CHECK(any_contains(lines, "GPUs 0-7 talk over PCIe only: prefer data parallelism; sharding moves 1.5x the bytes"));
  CHECK(any_contains(lines, "GPUs {0-3} and {4-7} sit under different CPU sockets (SYS)"));
  CHECK(cohort::suggested_link_preset(topo) == "pcie-gen4");

  SECTION("a GPU in a narrow slot, and one running below its slot's width") {
    topo.gpus[2].pcie_max_width = 8;
    topo.gpus[2].pcie_width = 8;
    topo.gpus[5].pcie_width = 4;
    lines = cohort::advice(topo);
    CHECK(any_contains(lines, "GPU2 sits in an x8 slot"));
    CHECK(any_contains(lines, "GPU5 runs x4 of x16 possible"));
    CHECK(cohort::format_topology_matrix(topo).find("GPU5: NVIDIA L40S, 0000:60:00.0, PCIe Gen4 x4 (max Gen4 x16)") !=
          std::string::npos);
  }
}

TEST_CASE("topology: a 4-GPU box with NVLink bridges in pairs across sockets") {
  const auto topo =
      cohort::make_topology(gpus(4, "NVIDIA A100 80GB PCIe", 8, 4, 16, 2), [](std::size_t a, std::size_t b) {
        link_evidence e;
        e.nvlink_count = (a / 2 == b / 2) ? 12 : 0;
        e.ancestor = (a / 2 == b / 2) ? pcie_ancestor::host_bridge : pcie_ancestor::system;
        return e;
      });
  const std::string text = cohort::format_topology_matrix(topo);
  CHECK_THAT(text, Catch::Contains(expected_row("GPU1", {"NV12", "X", "SYS", "SYS"}, "0")));
  CHECK(topo.link(2, 3).nvlink_version == 3);
  const auto lines = cohort::advice(topo);
  CHECK(any_contains(lines, "GPUs 0,1 share NVLink"));
  CHECK(any_contains(lines, "GPUs 2,3 share NVLink"));
  CHECK_FALSE(any_contains(lines, "PCIe only"));
  CHECK(any_contains(lines, "{0,1} and {2,3}"));
  CHECK(cohort::suggested_link_preset(topo) == "pcie-gen4");  // the ring over all four crosses PCIe
}

TEST_CASE("topology: without NVML the classes come from NUMA affinity") {
  auto box = gpus(4, "GPU", 0, 0, 0, 2);
  const auto topo = cohort::make_topology(box, [](std::size_t, std::size_t) {
    link_evidence e;
    e.p2p_supported = true;
    return e;
  });
  CHECK(topo.link(0, 1).kind == link_class::pcie_host_bridge);
  CHECK(topo.link(1, 2).kind == link_class::cross_socket);
  CHECK(cohort::suggested_link_preset(topo).empty());  // PCIe generation unknown
  const std::string text = cohort::format_topology_matrix(topo);
  CHECK_THAT(text, Catch::Contains("GPU0: GPU, 0000:10:00.0, NUMA 0\n"));

  box[0].numa_node = box[1].numa_node = -1;
  const auto unknown = cohort::make_topology(box, [](std::size_t, std::size_t) { return link_evidence{}; });
  CHECK(unknown.link(0, 1).kind == link_class::none);
  CHECK(any_contains(cohort::advice(unknown), "could not be classified"));
  CHECK_THAT(cohort::format_topology_matrix(unknown),
             Catch::Contains(expected_row("GPU0", {"X", "?", "?", "?"}, "N/A")));
}

TEST_CASE("topology: empty and single-GPU boxes") {
  cohort::topology empty;
  empty.notes.push_back("no CUDA device (test)");
  CHECK_THAT(cohort::format_topology_matrix(empty),
             Catch::Contains("no GPUs") && Catch::Contains("note: no CUDA device (test)"));
  CHECK(any_contains(cohort::advice(empty), "no CUDA device visible"));
  const auto one =
      cohort::make_topology(gpus(1, "GPU", 9, 5, 16, 1), [](std::size_t, std::size_t) { return link_evidence{}; });
  CHECK(any_contains(cohort::advice(one), "one GPU"));
  CHECK(cohort::suggested_link_preset(one).empty());
}

TEST_CASE("topology: probing this machine reports what it finds, or why nothing") {
  const auto topo = cohort::probe_topology();
  if (topo.size() == 0) {
    REQUIRE_FALSE(topo.notes.empty());
#if COHORT_TOPOLOGY_CAN_PROBE
    CHECK_THAT(topo.notes.front(), Catch::Contains("no CUDA device"));
#else
    CHECK_THAT(topo.notes.front(), Catch::Contains("without CUDA"));
#endif
    CHECK(any_contains(cohort::advice(topo), "no CUDA device visible"));
    return;
  }
  // A real machine: a square matrix with X on the diagonal and a class for every pair.
  for (std::size_t a = 0; a < topo.size(); ++a) {
    CHECK(topo.link(a, a).kind == link_class::self);
    CHECK_FALSE(topo.gpus[a].pci_bus_id.empty());
  }
  const std::string text = cohort::format_topology_matrix(topo);
  CHECK_THAT(text, Catch::Contains("GPU0"));
  std::printf("%s", text.c_str());
  for (const auto& line : cohort::advice(topo)) std::printf("advice: %s\n", line.c_str());
}
