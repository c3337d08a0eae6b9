// Distributions and the sampler (spec 4; clover-sampling.cpp), and the distribution's view of a draft window:
// drafts under the grammar and the penalties of a window's known targets. Not part of the C API.

#pragma once

#include "block-diffusion.h"  // common/: common_block_penalties
#include "clover-run.h"
#include "llama.h"

#include <cstdint>
#include <string>
#include <vector>

// distributions and the sampler (spec 4; clover-sampling.cpp)
llama_token   clover_argmax(const clover_sampler & smp, const float * logits, int32_t n_vocab);
// The tokens of a verification's rows by llama.cpp's rule (common_sampler_sample_and_accept_n): rows[i] holds the
// logits after drafts[0 .. i-1] (rows.size() == drafts.size() + 1); its token is the chain's draw after the tokens
// before it (greedy: argmax P; sampling: a draw from Q, the grammar applied first, spec 4), and the drafts are kept
// while they equal the draws. The chain accepts each token (penalties, grammar); with logprobs on, each token's log P
// at its row is recorded (clover_dist::logprobs). false when no token is allowed (slot->last_error).
bool          clover_sample_rows(clover_run & run, const std::vector<float *> & rows, const llama_tokens & drafts,
                                 std::vector<llama_token> & tokens);
// a GBNF grammar parses against the vocabulary and allows some token at its start (NULL or "" root = "root");
// 0, or -1 with a message
int32_t       clover_check_grammar(const llama_vocab * vocab, const char * grammar, const char * root,
                                   const std::vector<uint8_t> & excluded, std::string & err);
// The distribution stage (spec 4): the chain's logit bias and penalties (common_sampler_apply_stage) and, with
// full_grammar, -inf for what the grammar forbids, in place on one target's logits. Without full_grammar the grammar
// is left to the caller: a draft's (clover_draft_grammar) checks only the winner, as llama.cpp's common_sampler does.
void          clover_dist_apply(clover_run & run, float * logits, bool full_grammar);
// a produced response token, in order: the penalties count it and the grammar advances over it
void          clover_dist_produce(clover_run & run, llama_token token);
// log P of token, and the top alternatives, of adjusted logits (the excluded ids and -inf ones have none)
clover_logprob clover_dist_logprob(const clover_run & run, const float * logits, llama_token token);
// bias, penalties (the call's, else the GGUF's) and logprobs of a call; false with a message
bool          clover_init_dist(const clover_slot * slot, const clover_gen_params * params, clover_dist & dist,
                               std::string & err);

// banned and stop ids, temperature
bool          clover_init_sampler(const clover_slot * slot, const clover_gen_params * params, clover_sampler & smp,
                                  std::string & err);
// the call's llama.cpp chain (clover_sampler::chain) from its checked sampler and distribution settings, with its
// grammar (clover_run::grammar)
bool          clover_init_chain(const clover_slot * slot, const clover_gen_params * params, clover_run & run,
                                std::string & err);

// Drafts under the call's grammar (spec and auto): a copy of its state, advanced over the window's tokens in order,
// so that each draft is the best token the grammar allows after the drafts before it, and grammatical drafts can be
// accepted. Verification still decides; a window the grammar cannot follow ends the copy (later drafts are plain).
class clover_draft_grammar {
  public:
    explicit clover_draft_grammar(const clover_run & run);
    // a token the window already holds (an n-gram prefix, a target a LowConfidence step filled)
    void        known(clover_run & run, llama_token token);
    // the draft for the next target, from its adjusted logits
    llama_token draft(clover_run & run, float * logits);

  private:
    // the state after the token, or none when the grammar forbids it or it ends the text
    void advance(clover_run & run, llama_token token, bool forbidden);

    llama_sampler_ptr state;  // NULL: no grammar, or the window left it
};

// The penalties inside a window (spec 4): for a target, the window's targets known at the start of the step, at
// earlier positions, count as well. common's counter (common_block_penalties) stands in for the chain's penalties while
// this is in scope; advance(j) counts the known targets before j (call it with rising j).
class clover_window_counts {
  public:
    clover_window_counts(clover_run & run, const std::vector<llama_token> & canvas);
    ~clover_window_counts() { run.dist.window_penalties = nullptr; }
    clover_window_counts(const clover_window_counts &) = delete;
    clover_window_counts & operator=(const clover_window_counts &) = delete;

    void advance(int32_t j) { counts.advance(j); }

  private:
    clover_run             & run;
    common_block_penalties   counts;  // its sampler is NULL when no penalty is on
};
