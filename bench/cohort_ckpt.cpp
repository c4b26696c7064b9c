// cohort-ckpt: look into a checkpoint of a training state (cohort/parallel/checkpoint.hpp).
//
//   cohort-ckpt inspect DIR                     the newest complete checkpoint in DIR (or DIR
//                                               itself, a step-<N>): step, world, strategy,
//                                               regions, files, metadata
//   cohort-ckpt verify DIR                      reads every byte, checks every block's checksum
//   cohort-ckpt consolidate DIR OUT.safetensors the parameters, one tensor per region
#include <cohort/parallel/checkpoint.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

namespace {

// DIR itself when it holds an index, else its newest complete checkpoint.
std::string checkpoint_in(const std::string& directory) {
  if (std::filesystem::exists(std::filesystem::path(directory) / "manifest.json")) return directory;
  if (const auto newest = cohort::newest_checkpoint(directory)) return *newest;
  throw cohort::error(-1, "cohort-ckpt", "no complete checkpoint in " + directory,
                      "pass the directory a trainer saved to (step-<N> with manifest.json inside)");
}

int usage() {
  std::fprintf(stderr, "usage: cohort-ckpt inspect|verify DIR\n       cohort-ckpt consolidate DIR OUT.safetensors\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 3) return usage();
  const std::string verb = argv[1];
  const std::string checkpoint = checkpoint_in(argv[2]);
  if (verb == "inspect" && argc == 3) {
    const auto m = cohort::detail::read_checkpoint_manifest(checkpoint, -1);
    std::uint64_t elements = 0, bytes = 0;
    for (const auto& r : m.regions) elements += r.count;
    for (const auto& f : m.files) bytes += f.bytes;
    std::printf("%s\n  step %llu (optimizer steps %llu), saved by %d ranks under %s, parameters %s\n",
                checkpoint.c_str(), static_cast<unsigned long long>(m.step),
                static_cast<unsigned long long>(m.optimizer_steps), m.world_size, m.strategy.c_str(),
                m.parameter_dtype.c_str());
    std::printf("  %zu regions, %llu elements; tensors", m.regions.size(), static_cast<unsigned long long>(elements));
    for (const auto& t : m.tensors) std::printf(" %s", t.c_str());
    std::printf("\n  %zu files, %llu bytes, %llu-byte checksum blocks\n", m.files.size(),
                static_cast<unsigned long long>(bytes), static_cast<unsigned long long>(m.block_bytes));
    if (m.scaler)
      std::printf("  loss scale %g (%u good steps, %llu skipped)\n", m.scaler->scale, m.scaler->good_steps,
                  static_cast<unsigned long long>(m.scaler->skipped_steps));
    for (const auto& [key, value] : m.metadata) std::printf("  %s = %s\n", key.c_str(), value.c_str());
    return 0;
  }
  if (verb == "verify" && argc == 3) {
    const auto started = std::chrono::steady_clock::now();
    const auto bytes = cohort::verify_checkpoint(checkpoint);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("%s: every checksum matches (%llu bytes read in %.3f s)\n", checkpoint.c_str(),
                static_cast<unsigned long long>(bytes), seconds);
    return 0;
  }
  if (verb == "consolidate" && argc == 4) {
    cohort::consolidate_checkpoint(checkpoint, argv[3]);
    std::printf("%s -> %s\n", checkpoint.c_str(), argv[3]);
    return 0;
  }
  return usage();
} catch (const std::exception& failure) {
  std::fprintf(stderr, "cohort-ckpt: %s\n", failure.what());
  return 1;
}
