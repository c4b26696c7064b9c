#pragma once
// GPU link topology: which pairs of GPUs talk over NVLink, a PCIe switch, the CPU's host
// bridge, or across CPU sockets, printed as a matrix in the manner of `nvidia-smi topo -m`,
// with advice on what that means for data parallelism and sharding.
// Over 400 lines: one probe (CUDA and NVML through dlopen) and its report, used only by the
// tools (not in the umbrella header).
//
// The data model and the classification are pure functions, tested on synthetic boxes
// without a GPU. probe_topology() fills them from the machine: CUDA runtime for devices,
// bus ids and peer access; NVML, loaded with dlopen when the driver provides it, for NVLink
// links, PCIe generation and width, and the common PCIe ancestor of each pair. Without CUDA
// (cohort built without cohort::nccl) or without a device it returns an empty topology whose
// notes say why, never throws for a missing GPU.

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdio>
#include <fstream>
#include <functional>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/detail/text.hpp"
#include "cohort/error.hpp"

#if defined(COHORT_HAS_NCCL) && __has_include(<cuda_runtime.h>) && __has_include(<dlfcn.h>)
#define COHORT_TOPOLOGY_CAN_PROBE 1
#include <cuda_runtime.h>
#include <dlfcn.h>
#else
#define COHORT_TOPOLOGY_CAN_PROBE 0
#endif

namespace cohort::inline v0 {

// How two GPUs reach each other, best first (the order nvidia-smi's legend uses).
enum class link_class {
  self,                  // X    the same GPU
  nvlink,                // NV#  a bonded set of # NVLinks (direct or through NVSwitch)
  pcie_same_switch,      // PIX  at most one PCIe bridge (one switch) between them
  pcie_across_switches,  // PXB  several PCIe bridges, but not the CPU's host bridge
  pcie_host_bridge,      // PHB  through a PCIe host bridge (the CPU)
  pcie_same_numa,        // NODE across host bridges within one NUMA node
  cross_socket,          // SYS  across the inter-socket link (QPI/UPI, Infinity Fabric)
  none,                  // ?    not known
};

inline const char* label(link_class kind) noexcept {
  switch (kind) {
    case link_class::self: return "X";
    case link_class::nvlink: return "NV";
    case link_class::pcie_same_switch: return "PIX";
    case link_class::pcie_across_switches: return "PXB";
    case link_class::pcie_host_bridge: return "PHB";
    case link_class::pcie_same_numa: return "NODE";
    case link_class::cross_socket: return "SYS";
    case link_class::none: return "?";
  }
  return "?";
}

inline bool is_pcie(link_class kind) noexcept {
  return kind == link_class::pcie_same_switch || kind == link_class::pcie_across_switches ||
         kind == link_class::pcie_host_bridge || kind == link_class::pcie_same_numa;
}

// The deepest PCIe ancestor two devices share (NVML's nvmlGpuTopologyLevel_t, in our words).
enum class pcie_ancestor { unknown, same_board, single_switch, multiple_switches, host_bridge, numa_node, system };

// NVML's levels: INTERNAL 0, SINGLE 10, MULTIPLE 20, HOSTBRIDGE 30, NODE 40, SYSTEM 50.
inline pcie_ancestor pcie_ancestor_from_nvml_level(int level) noexcept {
  switch (level) {
    case 0: return pcie_ancestor::same_board;
    case 10: return pcie_ancestor::single_switch;
    case 20: return pcie_ancestor::multiple_switches;
    case 30: return pcie_ancestor::host_bridge;
    case 40: return pcie_ancestor::numa_node;
    case 50: return pcie_ancestor::system;
    default: return pcie_ancestor::unknown;
  }
}

// Everything the probe learns about one ordered pair; classify_link turns it into a class.
struct link_evidence {
  bool same_gpu = false;
  int nvlink_count = 0;  // active NVLinks between the two (through NVSwitch: the bonded set)
  pcie_ancestor ancestor = pcie_ancestor::unknown;
  bool p2p_supported = false;
  int numa_a = -1, numa_b = -1;  // NUMA node of each GPU's PCIe slot, -1 when unknown
};

inline link_class classify_link(const link_evidence& e) noexcept {
  if (e.same_gpu) return link_class::self;
  if (e.nvlink_count > 0) return link_class::nvlink;
  switch (e.ancestor) {
    case pcie_ancestor::same_board:  // two GPUs on one board share its switch
    case pcie_ancestor::single_switch: return link_class::pcie_same_switch;
    case pcie_ancestor::multiple_switches: return link_class::pcie_across_switches;
    case pcie_ancestor::host_bridge: return link_class::pcie_host_bridge;
    case pcie_ancestor::numa_node: return link_class::pcie_same_numa;
    case pcie_ancestor::system: return link_class::cross_socket;
    case pcie_ancestor::unknown: break;
  }
  // Without NVML: NUMA affinity still separates sockets; peer access alone cannot tell a
  // switch from the host bridge, so the cautious answer is the host bridge.
  if (e.numa_a >= 0 && e.numa_b >= 0 && e.numa_a != e.numa_b) return link_class::cross_socket;
  if (e.p2p_supported) return link_class::pcie_host_bridge;
  if (e.numa_a >= 0 && e.numa_a == e.numa_b) return link_class::pcie_same_numa;
  return link_class::none;
}

struct gpu_info {
  std::string name;
  std::string pci_bus_id;  // "0000:18:00.0"
  int numa_node = -1;
  int pcie_generation = 0;      // current (drops at idle to save power), 0 = unknown
  int pcie_width = 0;           // current lanes
  int pcie_max_generation = 0;  // what the link can do
  int pcie_max_width = 0;
  int compute_major = 0, compute_minor = 0;
};

struct gpu_link {
  link_class kind = link_class::none;
  int nvlink_count = 0;
  int nvlink_version = 0;  // 0 = unknown
  bool p2p_supported = false;
  int p2p_performance_rank = -1;  // CUDA's relative rank, lower is better; -1 = unknown
};

struct topology {
  std::vector<gpu_info> gpus;
  std::vector<std::vector<gpu_link>> links;  // links[a][b]
  std::vector<std::string> notes;            // what the probe could not see, and why

  std::size_t size() const noexcept { return gpus.size(); }
  const gpu_link& link(std::size_t a, std::size_t b) const {
    if (a >= gpus.size() || b >= gpus.size())
      throw error(-1, "topology",
                  detail::text("GPU pair (", std::to_string(a), ", ", std::to_string(b), ") outside ",
                               std::to_string(gpus.size()), " GPUs"));
    return links[a][b];
  }
};

// NVLink generation by GPU architecture: Pascal 1, Volta 2, Ampere 3, Hopper 4, Blackwell 5.
inline int nvlink_version_for_compute_capability(int major, int minor) noexcept {
  if (major == 6 && minor == 0) return 1;
  if (major == 7 && minor == 0) return 2;
  if (major == 8) return 3;
  if (major == 9) return 4;
  if (major == 10) return 5;
  return 0;
}

// "00000000:18:00.0", "0000:18:00.0" or "18:00.0" (any case) -> "0000:18:00.0"; "" when the
// text is not a PCI address. CUDA and NVML spell the domain with 4 and 8 digits.
inline std::string normalize_pci_bus_id(std::string_view text) {
  auto hex = [](std::string_view part, unsigned& value) {
    if (part.empty() || part.size() > 8) return false;
    auto [end, ec] = std::from_chars(part.data(), part.data() + part.size(), value, 16);
    return ec == std::errc{} && end == part.data() + part.size();
  };
  while (!text.empty() && (text.back() == '\0' || text.back() == ' ' || text.back() == '\n')) text.remove_suffix(1);
  unsigned domain = 0, bus = 0, device = 0, function = 0;
  const auto dot = text.rfind('.');
  if (dot == std::string_view::npos || !hex(text.substr(dot + 1), function)) return {};
  std::string_view head = text.substr(0, dot);
  const auto last_colon = head.rfind(':');
  if (last_colon == std::string_view::npos || !hex(head.substr(last_colon + 1), device)) return {};
  head = head.substr(0, last_colon);
  const auto first_colon = head.rfind(':');
  if (first_colon == std::string_view::npos) {
    if (!hex(head, bus)) return {};
  } else if (!hex(head.substr(first_colon + 1), bus) || !hex(head.substr(0, first_colon), domain)) {
    return {};
  }
  if (domain > 0xffff || bus > 0xff || device > 0x1f || function > 7) return {};
  char out[16];
  std::snprintf(out, sizeof out, "%04x:%02x:%02x.%x", domain, bus, device, function);
  return out;
}

// NVLink counts per GPU pair from each GPU's list of link endpoints (the PCI bus id at the far
// end of every active link). A link whose far end is another GPU joins that pair directly;
// one whose far end is not a GPU goes to an NVSwitch, and two GPUs on switches reach each
// other over as many links as the lesser of them has (what nvidia-smi shows as NV18 on HGX).
inline std::vector<std::vector<int>> nvlink_pair_counts(const std::vector<std::string>& gpu_bus_ids,
                                                        const std::vector<std::vector<std::string>>& link_endpoints) {
  const std::size_t n = gpu_bus_ids.size();
  if (link_endpoints.size() != n)
    throw error(
        -1, "nvlink_pair_counts",
        detail::text(std::to_string(n), " GPUs but endpoint lists for ", std::to_string(link_endpoints.size())));
  std::vector<std::string> ids(n);
  for (std::size_t i = 0; i < n; ++i) ids[i] = normalize_pci_bus_id(gpu_bus_ids[i]);
  std::vector<std::vector<int>> counts(n, std::vector<int>(n, 0));
  std::vector<int> switch_links(n, 0);
  for (std::size_t a = 0; a < n; ++a) {
    for (const auto& endpoint : link_endpoints[a]) {
      const std::string far = normalize_pci_bus_id(endpoint);
      const auto peer = std::find(ids.begin(), ids.end(), far);
      if (!far.empty() && peer != ids.end() && static_cast<std::size_t>(peer - ids.begin()) != a)
        ++counts[a][static_cast<std::size_t>(peer - ids.begin())];
      else if (far.empty() || peer == ids.end())
        ++switch_links[a];
    }
  }
  for (std::size_t a = 0; a < n; ++a)
    for (std::size_t b = 0; b < n; ++b) {
      if (a == b) continue;
      // Each side saw its own links; a direct link is counted once from either side.
      counts[a][b] = std::max(counts[a][b], counts[b][a]);
    }
  for (std::size_t a = 0; a < n; ++a)
    for (std::size_t b = 0; b < n; ++b)
      if (a != b && switch_links[a] > 0 && switch_links[b] > 0)
        counts[a][b] += std::min(switch_links[a], switch_links[b]);
  return counts;
}

// Builds the link matrix from evidence for each ordered pair (the pure half of the probe).
inline topology make_topology(std::vector<gpu_info> gpus,
                              const std::function<link_evidence(std::size_t, std::size_t)>& evidence) {
  topology topo;
  topo.gpus = std::move(gpus);
  const std::size_t n = topo.gpus.size();
  topo.links.assign(n, std::vector<gpu_link>(n));
  for (std::size_t a = 0; a < n; ++a)
    for (std::size_t b = 0; b < n; ++b) {
      link_evidence e = evidence(a, b);
      e.same_gpu = e.same_gpu || a == b;
      if (e.numa_a < 0) e.numa_a = topo.gpus[a].numa_node;
      if (e.numa_b < 0) e.numa_b = topo.gpus[b].numa_node;
      gpu_link& link = topo.links[a][b];
      link.kind = classify_link(e);
      link.p2p_supported = e.p2p_supported;
      if (link.kind == link_class::nvlink) {
        link.nvlink_count = e.nvlink_count;
        const auto& g = topo.gpus[a];
        link.nvlink_version = nvlink_version_for_compute_capability(g.compute_major, g.compute_minor);
      }
    }
  return topo;
}

inline std::string cell_label(const gpu_link& link) {
  if (link.kind == link_class::nvlink) return detail::text("NV", std::to_string(link.nvlink_count));
  return label(link.kind);
}

// The matrix, the legend, one line per GPU, and the probe's notes.
inline std::string format_topology_matrix(const topology& topo) {
  std::ostringstream out;
  const std::size_t n = topo.size();
  if (n == 0) {
    out << "no GPUs\n";
  } else {
    auto column = [&](const std::string& text) {
      out << text;
      for (std::size_t i = text.size(); i < 8; ++i) out << ' ';
    };
    column("");
    for (std::size_t b = 0; b < n; ++b) column(detail::text("GPU", std::to_string(b)));
    out << "NUMA Affinity\n";
    for (std::size_t a = 0; a < n; ++a) {
      column(detail::text("GPU", std::to_string(a)));
      for (std::size_t b = 0; b < n; ++b) {
        std::string cell(1, ' ');  // built in place: GCC 12 -O3 warns falsely on " " + string
        cell += cell_label(topo.links[a][b]);
        column(cell);
      }
      out << (topo.gpus[a].numa_node >= 0 ? std::to_string(topo.gpus[a].numa_node) : "N/A") << "\n";
    }
    out << "\nLegend:\n"
        << "  X    = the GPU itself\n"
        << "  NV#  = a bonded set of # NVLinks (direct or through NVSwitch)\n"
        << "  PIX  = PCIe through at most one bridge (a shared switch)\n"
        << "  PXB  = PCIe through several bridges, not the CPU's host bridge\n"
        << "  PHB  = PCIe through a host bridge (the CPU)\n"
        << "  NODE = PCIe across host bridges within one NUMA node\n"
        << "  SYS  = PCIe plus the link between CPU sockets (QPI/UPI, Infinity Fabric)\n"
        << "  ?    = not known\n\n";
    for (std::size_t a = 0; a < n; ++a) {
      const auto& g = topo.gpus[a];
      out << "GPU" << a << ": " << (g.name.empty() ? "unnamed" : g.name);
      if (!g.pci_bus_id.empty()) out << ", " << g.pci_bus_id;
      if (g.pcie_generation > 0 || g.pcie_width > 0) {
        out << ", PCIe Gen" << g.pcie_generation << " x" << g.pcie_width;
        if (g.pcie_max_generation > 0 &&
            (g.pcie_max_generation != g.pcie_generation || g.pcie_max_width != g.pcie_width))
          out << " (max Gen" << g.pcie_max_generation << " x" << g.pcie_max_width << ")";
      }
      if (g.numa_node >= 0) out << ", NUMA " << g.numa_node;
      int version = 0;
      for (std::size_t b = 0; b < n; ++b) version = std::max(version, topo.links[a][b].nvlink_version);
      if (version > 0) out << ", NVLink " << version;
      out << "\n";
    }
  }
  for (const auto& note : topo.notes) out << "note: " << note << "\n";
  return out.str();
}

namespace detail {
// "0-3", "0,2,5", "0-3,6": compact GPU lists for advice text.
inline std::string format_gpu_list(std::vector<std::size_t> ids) {
  std::sort(ids.begin(), ids.end());
  std::string out;
  for (std::size_t i = 0; i < ids.size();) {
    std::size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(ids[i]);
    if (j > i) out += (j == i + 1 ? "," : "-") + std::to_string(ids[j]);
    i = j + 1;
  }
  return out;
}

// Groups of GPUs joined by links for which `joined` holds (connected components).
inline std::vector<std::vector<std::size_t>> link_groups(const topology& topo,
                                                         const std::function<bool(const gpu_link&)>& joined) {
  const std::size_t n = topo.size();
  std::vector<std::size_t> parent(n);
  std::iota(parent.begin(), parent.end(), std::size_t{0});
  std::function<std::size_t(std::size_t)> root = [&](std::size_t x) {
    return parent[x] == x ? x : parent[x] = root(parent[x]);
  };
  for (std::size_t a = 0; a < n; ++a)
    for (std::size_t b = a + 1; b < n; ++b)
      if (joined(topo.links[a][b])) parent[root(a)] = root(b);
  std::vector<std::vector<std::size_t>> groups;
  std::vector<long> index_of_root(n, -1);
  for (std::size_t a = 0; a < n; ++a) {
    const std::size_t r = root(a);
    if (index_of_root[r] < 0) {
      index_of_root[r] = static_cast<long>(groups.size());
      groups.emplace_back();
    }
    groups[static_cast<std::size_t>(index_of_root[r])].push_back(a);
  }
  return groups;
}
}  // namespace detail

// What the matrix means for training, in words.
inline std::vector<std::string> advice(const topology& topo) {
  std::vector<std::string> lines;
  const std::size_t n = topo.size();
  if (n == 0) {
    lines.push_back("no CUDA device visible: nothing to advise");
    return lines;
  }
  if (n == 1) {
    lines.push_back("one GPU: no links to plan for; data parallelism needs at least two");
    return lines;
  }
  auto is_nv = [](const gpu_link& l) { return l.kind == link_class::nvlink; };
  bool all_nvlink = true, any_nvlink = false, any_sys = false, any_unknown = false;
  int min_count = 1 << 30;
  for (std::size_t a = 0; a < n; ++a)
    for (std::size_t b = 0; b < n; ++b) {
      if (a == b) continue;
      const auto& l = topo.links[a][b];
      if (is_nv(l)) {
        any_nvlink = true;
        min_count = std::min(min_count, l.nvlink_count);
      } else {
        all_nvlink = false;
      }
      any_sys = any_sys || l.kind == link_class::cross_socket;
      any_unknown = any_unknown || l.kind == link_class::none;
    }
  const std::string all = detail::format_gpu_list([&] {
    std::vector<std::size_t> ids(n);
    std::iota(ids.begin(), ids.end(), std::size_t{0});
    return ids;
  }());
  if (all_nvlink) {
    lines.push_back(
        detail::text("GPUs ", all, " are all joined by NVLink (at least NV", std::to_string(min_count),
                     "): data parallelism and sharding both run at NVLink speed; sharding moves 1.5x the bytes "
                     "of data parallelism, worth it once the model does not fit one GPU"));
  } else {
    if (any_nvlink) {
      for (const auto& group : detail::link_groups(topo, is_nv))
        if (group.size() > 1)
          lines.push_back(
              detail::text("GPUs ", detail::format_gpu_list(group),
                           " share NVLink: keep bandwidth-heavy groups (sharding) inside them; a ring over all "
                           "GPUs runs at the speed of the PCIe links between the groups"));
    }
    std::vector<std::size_t> pcie_only;
    for (std::size_t a = 0; a < n; ++a) {
      bool has_nv = false;
      for (std::size_t b = 0; b < n; ++b) has_nv = has_nv || (a != b && is_nv(topo.links[a][b]));
      if (!has_nv) pcie_only.push_back(a);
    }
    if (!pcie_only.empty())
      lines.push_back(detail::text("GPUs ", detail::format_gpu_list(pcie_only),
                                   " talk over PCIe only: prefer data parallelism; sharding moves 1.5x the bytes "
                                   "(3(p-1)/p instead of 2(p-1)/p of the model per step, every micro-batch)"));
  }
  if (any_sys) {
    auto groups = detail::link_groups(topo, [](const gpu_link& l) { return l.kind != link_class::cross_socket; });
    std::string text;
    for (const auto& group : groups)
      text += detail::text((text.empty() ? "{" : " and {"), detail::format_gpu_list(group), "}");
    lines.push_back(
        detail::text("GPUs ", text,
                     " sit under different CPU sockets (SYS): traffic between them crosses the "
                     "inter-socket link, the slowest in the box; for jobs smaller than the box keep each job on one "
                     "socket (CUDA_VISIBLE_DEVICES)"));
  }
  if (any_unknown)
    lines.push_back(
        "some links could not be classified (no NVML and no NUMA information): measure them with "
        "cohort-bench");
  for (std::size_t a = 0; a < n; ++a) {
    const auto& g = topo.gpus[a];
    if (g.pcie_max_width > 0 && g.pcie_max_width < 16)
      lines.push_back(detail::text("GPU", std::to_string(a), " sits in an x", std::to_string(g.pcie_max_width),
                                   " slot: ", (g.pcie_max_width <= 8 ? "half or less" : "less"),
                                   " of the bandwidth of x16 for everything that crosses PCIe"));
    else if (g.pcie_width > 0 && g.pcie_max_width > 0 && g.pcie_width < g.pcie_max_width)
      lines.push_back(detail::text("GPU", std::to_string(a), " runs x", std::to_string(g.pcie_width), " of x",
                                   std::to_string(g.pcie_max_width),
                                   " possible: a riser, a bifurcated slot or a downtrained link"));
  }
  return lines;
}

// The cohort-plan link preset closest to this box, or "" when none fits.
inline std::string suggested_link_preset(const topology& topo) {
  const std::size_t n = topo.size();
  if (n < 2) return {};
  bool all_nvlink = true;
  int version = 1 << 30;
  for (std::size_t a = 0; a < n; ++a)
    for (std::size_t b = 0; b < n; ++b)
      if (a != b) {
        all_nvlink = all_nvlink && topo.links[a][b].kind == link_class::nvlink;
        version = std::min(version, topo.links[a][b].nvlink_version);
      }
  if (all_nvlink) return version >= 4 ? "nvlink-h100" : version == 3 ? "nvlink-a100" : "";
  int generation = 1 << 30;
  for (const auto& g : topo.gpus)
    generation = std::min(generation, g.pcie_max_generation > 0 ? g.pcie_max_generation : g.pcie_generation);
  if (generation >= 5 && generation < (1 << 30)) return "pcie-gen5";
  if (generation == 4) return "pcie-gen4";
  return {};
}

// ---------------------------------------------------------------------------------------
// Probing the machine.

#if COHORT_TOPOLOGY_CAN_PROBE
namespace detail {

// The few NVML declarations the probe needs, spelled here so that nvml.h is not required.
// Layouts follow NVML's public header (nvmlPciInfo_t v2+: legacy id, ids, then the 32-byte id).
struct nvml_pci_info {
  char bus_id_legacy[16];
  unsigned domain, bus, device, pci_device_id, pci_subsystem_id;
  char bus_id[32];
};
using nvml_device = struct nvml_device_opaque*;

class nvml_library {
 public:
  nvml_library() {
    handle_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!handle_) return;
    bool ok = load(init_, "nvmlInit_v2") && load(shutdown_, "nvmlShutdown") &&
              load(by_bus_id_, "nvmlDeviceGetHandleByPciBusId_v2");
    load(nvlink_state_, "nvmlDeviceGetNvLinkState");
    load(nvlink_remote_, "nvmlDeviceGetNvLinkRemotePciInfo_v2");
    load(curr_gen_, "nvmlDeviceGetCurrPcieLinkGeneration");
    load(curr_width_, "nvmlDeviceGetCurrPcieLinkWidth");
    load(max_gen_, "nvmlDeviceGetMaxPcieLinkGeneration");
    load(max_width_, "nvmlDeviceGetMaxPcieLinkWidth");
    load(ancestor_, "nvmlDeviceGetTopologyCommonAncestor");
    initialized_ = ok && init_() == 0;
  }
  ~nvml_library() {
    if (initialized_) shutdown_();
    if (handle_) dlclose(handle_);
  }
  nvml_library(const nvml_library&) = delete;
  nvml_library& operator=(const nvml_library&) = delete;

  bool available() const { return initialized_; }
  bool loaded() const { return handle_ != nullptr; }

  nvml_device device(const std::string& bus_id) const {
    nvml_device device = nullptr;
    if (!initialized_ || by_bus_id_(bus_id.c_str(), &device) != 0) return nullptr;
    return device;
  }
  void pcie(nvml_device device, gpu_info& info) const {
    unsigned value = 0;
    if (curr_gen_ && curr_gen_(device, &value) == 0) info.pcie_generation = int(value);
    if (curr_width_ && curr_width_(device, &value) == 0) info.pcie_width = int(value);
    if (max_gen_ && max_gen_(device, &value) == 0) info.pcie_max_generation = int(value);
    if (max_width_ && max_width_(device, &value) == 0) info.pcie_max_width = int(value);
  }
  // The bus id at the far end of each active NVLink.
  std::vector<std::string> nvlink_endpoints(nvml_device device) const {
    std::vector<std::string> endpoints;
    if (!nvlink_state_ || !nvlink_remote_) return endpoints;
    constexpr unsigned max_links = 18;  // NVML_NVLINK_MAX_LINKS in current drivers
    for (unsigned link = 0; link < max_links; ++link) {
      int active = 0;
      if (nvlink_state_(device, link, &active) != 0 || active != 1) continue;
      nvml_pci_info remote{};
      if (nvlink_remote_(device, link, &remote) != 0) continue;
      endpoints.emplace_back(remote.bus_id);
    }
    return endpoints;
  }
  pcie_ancestor ancestor(nvml_device a, nvml_device b) const {
    int level = -1;
    if (!ancestor_ || ancestor_(a, b, &level) != 0) return pcie_ancestor::unknown;
    return pcie_ancestor_from_nvml_level(level);
  }

 private:
  template <class F>
  bool load(F& function, const char* name) {
    function = reinterpret_cast<F>(dlsym(handle_, name));
    return function != nullptr;
  }

  void* handle_ = nullptr;
  bool initialized_ = false;
  int (*init_)() = nullptr;
  int (*shutdown_)() = nullptr;
  int (*by_bus_id_)(const char*, nvml_device*) = nullptr;
  int (*nvlink_state_)(nvml_device, unsigned, int*) = nullptr;
  int (*nvlink_remote_)(nvml_device, unsigned, nvml_pci_info*) = nullptr;
  int (*curr_gen_)(nvml_device, unsigned*) = nullptr;
  int (*curr_width_)(nvml_device, unsigned*) = nullptr;
  int (*max_gen_)(nvml_device, unsigned*) = nullptr;
  int (*max_width_)(nvml_device, unsigned*) = nullptr;
  int (*ancestor_)(nvml_device, nvml_device, int*) = nullptr;
};

inline int numa_node_of(const std::string& bus_id) {
  std::ifstream in(detail::text("/sys/bus/pci/devices/", bus_id, "/numa_node"));
  int node = -1;
  if (in >> node && node >= 0) return node;
  return -1;
}

}  // namespace detail
#endif

// The links of this machine's visible GPUs. Never throws for a missing GPU or driver: the
// result is then empty and its notes say why.
inline topology probe_topology() {
  topology topo;
#if COHORT_TOPOLOGY_CAN_PROBE
  int count = 0;
  if (const cudaError_t status = cudaGetDeviceCount(&count); status != cudaSuccess) {
    topo.notes.push_back(detail::text("no CUDA device (cudaGetDeviceCount: ", cudaGetErrorString(status), ")"));
    (void)cudaGetLastError();  // clear the sticky error for whoever uses CUDA next
    return topo;
  }
  if (count == 0) {
    topo.notes.push_back("no CUDA device (cudaGetDeviceCount returned 0)");
    return topo;
  }
  const auto n = static_cast<std::size_t>(count);
  std::vector<gpu_info> gpus(n);
  for (int i = 0; i < count; ++i) {
    auto& g = gpus[static_cast<std::size_t>(i)];
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) == cudaSuccess) {
      g.name = prop.name;
      g.compute_major = prop.major;
      g.compute_minor = prop.minor;
    }
    char bus_id[32] = {};
    if (cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, i) == cudaSuccess) g.pci_bus_id = normalize_pci_bus_id(bus_id);
    if (!g.pci_bus_id.empty()) g.numa_node = detail::numa_node_of(g.pci_bus_id);
  }
  std::vector<std::vector<int>> p2p(n, std::vector<int>(n, 0)), rank(n, std::vector<int>(n, -1));
  for (int a = 0; a < count; ++a)
    for (int b = 0; b < count; ++b) {
      if (a == b) continue;
      int value = 0;
      if (cudaDeviceGetP2PAttribute(&value, cudaDevP2PAttrAccessSupported, a, b) == cudaSuccess)
        p2p[std::size_t(a)][std::size_t(b)] = value;
      if (cudaDeviceGetP2PAttribute(&value, cudaDevP2PAttrPerformanceRank, a, b) == cudaSuccess)
        rank[std::size_t(a)][std::size_t(b)] = value;
    }
  (void)cudaGetLastError();

  detail::nvml_library nvml;
  std::vector<detail::nvml_device> handles(n, nullptr);
  std::vector<std::vector<int>> nvlinks(n, std::vector<int>(n, 0));
  if (nvml.available()) {
    std::vector<std::string> ids;
    std::vector<std::vector<std::string>> endpoints;
    for (std::size_t i = 0; i < n; ++i) {
      handles[i] = nvml.device(gpus[i].pci_bus_id);
      if (handles[i]) nvml.pcie(handles[i], gpus[i]);
      ids.push_back(gpus[i].pci_bus_id);
      endpoints.push_back(handles[i] ? nvml.nvlink_endpoints(handles[i]) : std::vector<std::string>{});
    }
    nvlinks = nvlink_pair_counts(ids, endpoints);
  } else {
    topo.notes.push_back(nvml.loaded() ? "NVML found but failed to initialise: NVLink and PCIe details unknown"
                                       : "NVML (libnvidia-ml.so.1) not found: NVLink and PCIe details unknown; "
                                         "classes come from peer access and NUMA affinity");
  }
  topo = [&] {
    topology built = make_topology(gpus, [&](std::size_t a, std::size_t b) {
      link_evidence e;
      e.same_gpu = a == b;
      e.nvlink_count = nvlinks[a][b];
      e.p2p_supported = p2p[a][b] != 0;
      if (handles[a] && handles[b] && a != b) e.ancestor = nvml.ancestor(handles[a], handles[b]);
      return e;
    });
    for (std::size_t a = 0; a < n; ++a)
      for (std::size_t b = 0; b < n; ++b) built.links[a][b].p2p_performance_rank = rank[a][b];
    built.notes = topo.notes;
    return built;
  }();
#else
  topo.notes.push_back(
      "cohort was built without CUDA (cohort::nccl): no probe; link classes can still be "
      "given by hand to make_topology");
#endif
  return topo;
}

}  // namespace cohort::inline v0
