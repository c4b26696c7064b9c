#pragma once
// Which specializations cohort's compiled library holds (COHORT_SEPARATE_COMPILATION: the
// default targets, cohort::gloo and cohort::nccl). One list, in two forms: the macro that
// cohort/detail/instantiations.hpp declares extern and cohort/src.hpp defines, and the traits
// with which process_group and training_state refuse, at compile time, a specialization the
// library lacks in a unit that does not compile the template bodies itself
// (COHORT_TEMPLATE_BODIES).

#include <type_traits>

#include "cohort/types.hpp"

namespace cohort::inline v0 {

class gloo;
class nccl;

namespace detail {
template <class B>
inline constexpr bool compiled_backend = std::is_same_v<B, gloo> || std::is_same_v<B, nccl>;
template <class B, class P, class G>
inline constexpr bool compiled_specialization = compiled_backend<B>&& std::is_same_v<P, G> &&
                                                (std::is_same_v<P, float> || std::is_same_v<P, bfloat16>);
}  // namespace detail

}  // namespace cohort::inline v0

// KEYWORD: `extern` for the program's translation units, empty in cohort/src.hpp.
// process_group<B>: its bodies are in comm/impl/process_group.hpp, parsed as training_state's.
#define COHORT_INSTANTIATIONS(KEYWORD, B)     \
  KEYWORD template class process_group<B>;    \
  COHORT_INSTANTIATIONS_OF(KEYWORD, B, float) \
  COHORT_INSTANTIATIONS_OF(KEYWORD, B, bfloat16)

// training_state<B, P> and the checkpoint functions over it: their bodies are in the impl
// headers, which only the library's unit (and units asking for COHORT_TEMPLATE_BODIES) parse.
// The arguments are template arguments and a keyword, which parentheses would break.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define COHORT_INSTANTIATIONS_OF(KEYWORD, B, P)                                                                \
  KEYWORD template class training_state<B, P>;                                                                 \
  KEYWORD template class async_checkpointer<B, P, P>;                                                          \
  KEYWORD template checkpoint_info save_checkpoint(training_state<B, P>&, const std::string&, std::uint64_t,   \
                                                   const checkpoint_options&);                                 \
  KEYWORD template checkpoint_info load_checkpoint(training_state<B, P>&, const std::string&);                 \
  KEYWORD template std::optional<checkpoint_info> resume_checkpoint(training_state<B, P>&, const std::string&, \
                                                                    const resume_options&);
// NOLINTEND(bugprone-macro-parentheses)
