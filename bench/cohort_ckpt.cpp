// cohort-ckpt: look into a checkpoint of a training state (cohort/parallel/checkpoint.hpp).
//
//   cohort-ckpt inspect DIR                     the newest committed checkpoint in DIR (or DIR
//                                               itself, a step-<N>): step, world, strategy,
//                                               metadata, then each region's name, dtype,
//                                               shape, elements and bytes, then the files,
//                                               last `parameters sha256 <hex>`: the digest
//                                               parameter_sha256 gives the live state
//                                               (cohort/parallel/fingerprint.hpp), from the
//                                               parameters' bytes, read and their blocks
//                                               verified (a damaged one: exit 1 after the
//                                               listing)
//   cohort-ckpt verify DIR                      checks the index, reads every byte, checks every
//                                               block's checksum
//   cohort-ckpt consolidate DIR OUT.safetensors the parameters, one tensor per region, shaped
//
// Each reads the index only after its checksum and its checks passed, and opens nothing but
// the regular files of the checkpoint's directory; a damaged checkpoint exits 1 naming the
// file ("cohort-ckpt VERB: DIR/step-<N> is damaged: why"). In a directory cohort saved to, a
// step-<N> whose index cannot be read is damaged, never skipped for an older one. Entries of
// DIR named like a checkpoint that are not cohort's are named on stderr and never read.
#include <cohort/parallel/checkpoint.hpp>
#include <cohort/parallel/fingerprint.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

namespace {

// DIR itself when it holds an index, else its newest committed checkpoint.
std::string checkpoint_in(const std::string& directory) {
  if (std::filesystem::exists(std::filesystem::path(directory) / "manifest.json")) return directory;
  const auto listing = cohort::detail::list_checkpoints(directory);
  for (const auto& ignored : listing.ignored) cohort::detail::checkpoint_warning(-1, ignored);
  if (!listing.committed.empty()) return listing.committed.back().second;
  throw cohort::error(-1, "cohort-ckpt", "no committed checkpoint in " + directory,
                      "pass the directory a trainer saved to (step-<N> with manifest.json inside)");
}

int usage() {
  std::fprintf(stderr, "usage: cohort-ckpt inspect|verify DIR\n       cohort-ckpt consolidate DIR OUT.safetensors\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return usage();
  const std::string verb = argv[1];
  std::string checkpoint;
  try {
    checkpoint = checkpoint_in(argv[2]);
    if (verb == "inspect" && argc == 3) {
      const auto manifest = cohort::detail::read_checkpoint_manifest(checkpoint, -1, "cohort-ckpt inspect");
      std::fputs(cohort::detail::describe_checkpoint(checkpoint, manifest).c_str(), stdout);
      // Unindented, as a run's last line is: the two compare by one grep.
      std::printf("parameters sha256 %s\n", cohort::checkpoint_parameter_sha256(checkpoint).c_str());
      return 0;
    }
    if (verb == "verify" && argc == 3) {
      const auto started = std::chrono::steady_clock::now();
      const auto bytes = cohort::verify_checkpoint(checkpoint);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      std::printf("%s: the index and every checksum match (%llu bytes read in %.3f s)\n", checkpoint.c_str(),
                  static_cast<unsigned long long>(bytes), seconds);
      return 0;
    }
    if (verb == "consolidate" && argc == 4) {
      cohort::consolidate_checkpoint(checkpoint, argv[3]);
      std::printf("%s -> %s\n", checkpoint.c_str(), argv[3]);
      return 0;
    }
    return usage();
  } catch (const cohort::checkpoint_damaged_error& failure) {
    // The tool's prefix once (the library's what() carries its own), then, for a directory,
    // the older checkpoints a resume would fall back to, each to be checked by name.
    std::string older;
    if (checkpoint != argv[2])
      for (const auto& [step, path] : cohort::detail::list_checkpoints(argv[2]).committed)
        if (path != checkpoint) older += " " + path;
    std::fprintf(stderr, "cohort-ckpt %s: %s is damaged: %s (hint: %s)\n", verb.c_str(), checkpoint.c_str(),
                 failure.detail().c_str(), failure.hint().c_str());
    if (!older.empty())
      std::fprintf(stderr, "cohort-ckpt %s: older checkpoints, which a resume falls back to:%s\n", verb.c_str(),
                   older.c_str());
  } catch (const cohort::error& failure) {
    std::string text = failure.detail();
    if (!failure.hint().empty()) text += " (hint: " + failure.hint() + ")";
    std::fprintf(stderr, "cohort-ckpt %s: %s\n", verb.c_str(), text.c_str());
  } catch (const std::exception& failure) {
    std::fprintf(stderr, "cohort-ckpt %s: %s\n", verb.c_str(), failure.what());
  }
  return 1;
}
