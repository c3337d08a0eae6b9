// Internals of the Clover decoding engine shared by its translation units. Not part of the C API.
//
//   clover.cpp           the C API of the engine and its slots (extern "C"), and the deprecated names
//   clover-params.cpp    the load plan and the load; a generate call's parameter checks, prefill and dispatch
//   clover-decode.cpp    batches and passes; the ar, diffusion and spec loops
//   clover-sampling.cpp  distributions and the sampler (spec 4)
//   clover-auto.cpp      auto mode and its cost table
//   clover-cache.cpp     the prefix cache (and its clover_slot_* functions)
//   clover-parallel.cpp  slots sharing one context, their passes batched in rounds
//   clover-offload.cpp   offload options, the memory plan, the fit checks, devices, RPC servers
//   clover-gguf.cpp      the clover settings and other header reads of a GGUF
//   clover-threads.cpp   the default thread count
//   clover-log.cpp       messages through llama.cpp's log callback

#pragma once

#include "clover.h"
#include "clover-llama.h"
#include "clover-log.h"
#include "llama.h"
#include "llama-cpp.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

struct clover_slot;

// A pass one slot waits to run (clover-parallel.cpp): the slot's batch, causal or a block window
struct clover_pass_req {
    clover_slot * slot    = nullptr;
    bool          block   = false;
    bool          prefill = false;  // a chunk of a prompt's prefill (clover_prefill)
    bool          done    = false;
    int32_t       rc      = 0;
};

// What the slots of one context share when n_parallel > 1: the lock that serializes their use of the context,
// the queue where their passes meet, and the thread that runs every pass on the context. A slot holds `mu` while
// it runs engine code; it waits on `cv` (and so releases `mu`) only for its pass. A round starts when every slot
// inside clover_slot_generate has queued a pass and no slot is waiting to take the lock (a generation never yields
// it otherwise).
//
// One thread decodes for all slots, as llama-server's one loop does. ggml's CPU backend (OpenMP) keeps a pool
// of workers per calling thread, and libgomp counts the workers of every pool: with a pool per slot thread they
// outnumber the cores, and libgomp then sleeps at each barrier instead of spinning. A one-token step of `mid`
// Q8_0 took 29 ms instead of 17 ms that way (2-core Xeon, two slot threads).
struct clover_shared {
    std::mutex                    mu;
    std::condition_variable       cv;
    std::atomic<int32_t>          n_entering{0};  // slots blocked on `mu` at the start of a C API call
    int32_t                       n_generating = 0;
    std::deque<clover_pass_req *> pending;
    llama_batch                   batch    = {};  // the combined batch of a round
    llama_context               * ctx      = nullptr;
    bool                          has_costs = false;  // auto mode's cost table, measured by the first slot that needs it
    clover_pass_costs             costs     = {};
    int32_t                       n_ubatch = 0;
    // Fair share while a slot prefills and others generate: the decode time of rounds that ran a prefill chunk,
    // and of rounds that ran other slots' passes while a chunk waited. A chunk waits while it is ahead.
    double                        t_prefill_ms = 0.0;
    double                        t_others_ms  = 0.0;
    std::atomic<int64_t>          n_passes{0};  // read without the lock (/health must not wait for a prefill)
    std::atomic<int64_t>          n_rounds{0};
    std::atomic<int64_t>          n_block_passes{0};  // the block passes among them, and the rounds that ran them
    std::atomic<int64_t>          n_block_rounds{0};
    // the decode thread (clover_decode_loop), and a call a slot hands it outside the rounds (clover_shared_call)
    std::thread                      decoder;
    bool                             stopping = false;
    const std::function<int32_t()> * call     = nullptr;
    int32_t                          call_rc  = 0;

    ~clover_shared();
};

// a copy of the history's recurrent state after its first n_past positions (clover-cache.cpp)
struct clover_checkpoint {
    int32_t              n_past   = 0;
    uint64_t             last_use = 0;
    std::vector<uint8_t> state;
};

// One history on the engine's context (clover.h's struct clover_slot). The model and the context are the
// engine's, borrowed.
// The cost table corrected by the passes a run times. A table is measured once, from about two dozen passes that
// take a few ms, and a disturbance in those ms skews it for the engine's life: twelve measurements in a row on a
// 2-core EPYC gave ar steps of 0.25 to 0.64 ms on the demo model. A table that overrates multi-row passes keeps
// auto in ar steps (TPF 1.00), and one that underrates them makes it slower than ar. Each kind of pass (ar step,
// chain pass, block pass) scales the table by the median of its last observed / predicted times, from its third
// observation on: one slow pass (the first after an idle spell, a preempted one) is always outvoted. Passes shared
// with other slots are not observed.
struct clover_cost_ratio {
    static constexpr int32_t N = 9;
    double  recent[N] = {};
    int32_t n = 0;  // observations so far (the last N are kept)

    void observe(double ms, double predicted) {
        if (ms > 0.0 && predicted > 0.0) {
            recent[n++ % N] = ms / predicted;
        }
    }

    static constexpr int32_t MIN = 3;

    double scale() const {
        if (n < MIN) {
            return 1.0;
        }
        std::vector<double> v(recent, recent + std::min(n, N));
        std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
        return v[v.size() / 2];
    }
};

struct clover_cost_correction {
    clover_cost_ratio ar;
    clover_cost_ratio chain;
    clover_cost_ratio block;

    // the table with every kind scaled by its correction
    clover_pass_costs apply(const clover_pass_costs & c) const {
        clover_pass_costs out = c;
        out.ar_ms           = (float) (c.ar_ms * ar.scale());
        out.causal_fixed_ms = (float) (c.causal_fixed_ms * chain.scale());
        out.causal_row_ms   = (float) (c.causal_row_ms * chain.scale());
        out.block_fixed_ms  = (float) (c.block_fixed_ms * block.scale());
        out.block_row_ms    = (float) (c.block_row_ms * block.scale());
        return out;
    }
};

// Auto mode's probe of a kind of round its cost table rules out (clover-auto.cpp): the kind is still taken now
// and then, so that its passes are timed and its drafts scored. Every FIRST rounds without it until the table's
// correction has `n_min` observations of it, then after twice as many rounds at each probe (a few probes over a
// slot's life, so their cost stays small); the count starts again when the kind is chosen on its merits.
struct clover_probe {
    static constexpr int32_t FIRST = 8;
    static constexpr int32_t LAST  = 1024;
    int32_t wait  = 0;
    int32_t every = FIRST;
    int32_t n     = 0;  // probes so far

    bool due(int32_t n_min) { return n < n_min ? ++wait >= FIRST : ++wait >= every; }
    void probed(int32_t n_min) {
        wait  = 0;
        every = ++n < n_min ? FIRST : std::min(2 * every, LAST);
    }
    void chosen() { *this = {}; }
};

// What auto learns of its cost table across a slot's calls (a chat's short answers do not each pay the first
// probes); cleared when the table is measured or set.
struct clover_auto_feedback {
    clover_cost_correction correction;
    clover_probe           chain_probe;
    clover_probe           block_probe;
};

struct clover_slot {
    llama_model       * model = nullptr;
    llama_context     * ctx   = nullptr;
    const llama_vocab * vocab = nullptr;
    llama_memory_t      mem   = nullptr;

    clover_model_info info = {};
    // block passes are possible: the file has the block-diffusion tensors and a mask token (else ar and auto with
    // n-gram drafts only; block_unavailable says why)
    bool        can_block = false;
    std::string block_unavailable;
    float       coreset_top_p = 1.0f;  // of this slot's current generation (clover_gen_params.coreset_top_p resolved)

    // this slot's sequences (slot i: 2i and 2i + 1)
    llama_seq_id seq_history = 0;
    llama_seq_id seq_scratch = 1;

    // n_parallel > 1: the queue and lock the slots share (null with one slot)
    std::shared_ptr<clover_shared>  shared;
    std::unique_lock<std::mutex>  * lock = nullptr;  // held while this slot runs engine code
    std::vector<float>              rows;      // logits this slot's last pass got in a round
    std::vector<std::string>        pieces;    // each token's bytes (special tokens rendered), made by the first
                                               // constrained call
    std::vector<int32_t>            row_of;    // batch row -> index in rows, or -1

    int32_t n_ctx          = 0;  // logical context size (llama.cpp may pad its own)
    int32_t n_batch        = 0;
    int32_t prefill_chunk  = 0;  // prompt tokens per prefill pass while another slot generates (<= n_batch)
    bool    prefilling     = false;  // inside clover_prefill: its passes are chunks (clover_pass_req::prefill)
    int32_t max_block_size = 0;
    int32_t n_vocab        = 0;

    std::vector<llama_token> eog_ids;  // the vocab's end-of-generation set

    // committed history: positions [0, n_past) on seq_history, whose tokens are history; the pending token (the last
    // known token, not yet committed: the spec's "seed"; `seed` in this code is only the sampler's RNG seed)
    // sits at n_past
    int32_t                  n_past      = 0;
    std::vector<llama_token> history;
    bool                     has_pending = false;
    llama_token              pending     = 0;

    llama_batch batch = {};  // this slot's passes (owned)
    int32_t     batch_cap = 0;

    // prefix cache (clover-cache.cpp): checkpoints along the committed history, sorted by n_past
    std::vector<clover_checkpoint> checkpoints;
    int64_t                        cache_max_bytes  = 0;
    int32_t                        checkpoint_every = 0;
    int32_t                        checkpoint_at    = -1;  // where the last prompt left the previous history
    std::vector<int32_t>           checkpoint_hints;       // clover_slot_checkpoint_hint
    bool                           rewound          = false;  // cancelled back to a checkpoint: only reuse_prefix continues
    uint64_t                       cache_clock      = 0;
    clover_cache_info              cache_stats      = {};

    bool              has_costs = false;  // auto mode's cost table (clover_slot_set_costs / measured)
    clover_pass_costs costs     = {};
    bool              costs_adaptive = false;  // auto corrects the table from the passes it times (a measured
                                               // table or clover_slot_set_cost_prior); a set table is kept as given
    clover_auto_feedback feedback;             // of an adaptive table: its correction and auto's probes

    std::string last_error;

    clover_slot() = default;
    ~clover_slot() { llama_batch_free(batch); }
    clover_slot(const clover_slot &) = delete;
    clover_slot & operator=(const clover_slot &) = delete;
};

// clover.h's struct clover_engine: the model and the context, and the slots that use them (declared last, so
// they go first)
struct clover_engine {
    llama_model_ptr                           model;
    llama_context_ptr                         ctx;
    std::vector<std::unique_ptr<clover_slot>> slots;  // slot 0 .. n_parallel - 1
};

struct clover_sampler {
    std::vector<uint8_t> excluded;  // mask token and banned ids
    std::vector<uint8_t> stop;      // end-of-generation ids
    float        temperature = 0.0f;
    int32_t      top_k       = 0;
    float        top_p       = 1.0f;
    std::mt19937 rng;

    std::vector<double>  probs;  // scratch: Q over the vocabulary
    std::vector<int32_t> order;  // scratch: top-p order

    bool greedy() const { return !(temperature > 0.0f); }

    double uniform() {
        // 53-bit uniform in [0, 1) from two 32-bit draws (portable across standard libraries)
        const uint64_t a = rng() >> 5;
        const uint64_t b = rng() >> 6;
        return (double) (a * 67108864ull + b) / 9007199254740992.0;
    }
};

// One emitted token's log P and its top alternatives (clover_gen_params.n_logprobs), held until the token is emitted
struct clover_logprob {
    llama_token              token;
    float                    logprob;
    std::vector<llama_token> top_ids;
    std::vector<float>       top_logprobs;
};

// A UTF-8 decoder's state between tokens: continuation bytes still due, and the range the next one must fall in
// (narrower after E0, ED, F0 and F4, which excludes overlong forms, surrogates and code points above U+10FFFF)
struct clover_utf8 {
    int32_t need = 0;
    uint8_t lo   = 0x80;
    uint8_t hi   = 0xBF;

    // feed a token's bytes; false when they break well-formed UTF-8 (the state is then unspecified)
    bool feed(const std::string & bytes);
};

// The distribution stage's request state (spec 4): logit_bias, the penalties over the response's tokens so far,
// and the grammar with its state after them (clover-sampling.cpp)
struct clover_dist {
    std::vector<std::pair<llama_token, float>> bias;
    float repeat    = 1.0f;
    float presence  = 0.0f;
    float frequency = 0.0f;

    std::vector<int32_t>     counts;   // n_vocab: each token's count in the response (kept when a penalty is on)
    std::vector<uint8_t>     listed;   // n_vocab: already in `seen`
    std::vector<llama_token> seen;     // the ids that were ever counted (the ones a penalty may touch)

    std::vector<uint8_t>     grammar_after;   // n_vocab, or empty: the grammar starts after one of these tokens
    llama_sampler_ptr        grammar_waiting; // the parsed grammar until one of them comes (grammar_after)
    llama_sampler_ptr        grammar_state;   // NULL until the grammar applies
    clover_utf8              utf8;          // the constrained text so far: a grammar judges code points, and llama.cpp's
                                            // decoder takes stray or overlong bytes as some, so the mask keeps the
                                            // text well-formed UTF-8 itself
    std::vector<llama_token_data> cur;      // scratch: the vocabulary for the grammar's mask

    int32_t                     n_logprobs = -1;
    std::vector<clover_logprob> logprobs;         // of the tokens produced and not yet emitted, in order
    std::vector<clover_logprob> window_logprobs;  // diffusion: of each window target, from the step that filled it

    bool penalized() const { return repeat != 1.0f || presence != 0.0f || frequency != 0.0f; }
    bool constrained() const { return grammar_state != nullptr; }
};

// one generate call
struct clover_run {
    clover_slot             * slot;
    const clover_gen_params * params;
    clover_sampler          smp;
    clover_dist             dist;
    int32_t                 block_size;
    float                   threshold;
    int32_t                 budget;
    int32_t                 n_out = 0;
    clover_tokens_cb        on_tokens;
    clover_step_cb          on_step;
    void                  * user_data;
    clover_stats          * stats;
    bool                    cancelled = false;

    int32_t remaining() const { return budget - n_out; }
    bool is_stop(llama_token t) const { return t >= 0 && t < (llama_token) smp.stop.size() && smp.stop[t]; }
};

inline constexpr llama_token CLOVER_EMPTY = -1;  // an unfilled canvas target

void clover_dist_count(clover_run & run, llama_token token, int32_t delta);

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
    clover_utf8       utf8;
};

// The penalties inside a window (spec 4): for a target, the window's targets known at the start of the step, at
// earlier positions, count as well. advance(j) counts the known targets before j (call it with rising j); the
// counts are taken back when this goes out of scope.
class clover_window_counts {
  public:
    clover_window_counts(clover_run & run, const std::vector<llama_token> & canvas) : run(run), canvas(canvas) {}
    ~clover_window_counts() {
        for (const llama_token t : added) {
            clover_dist_count(run, t, -1);
        }
    }
    clover_window_counts(const clover_window_counts &) = delete;
    clover_window_counts & operator=(const clover_window_counts &) = delete;

    void advance(int32_t j) {
        for (; next < j; ++next) {
            if (canvas[next] != CLOVER_EMPTY) {
                clover_dist_count(run, canvas[next], 1);
                added.push_back(canvas[next]);
            }
        }
    }

  private:
    clover_run                     & run;
    const std::vector<llama_token> & canvas;
    int32_t                          next = 0;
    std::vector<llama_token>         added;
};

// what one verification round did (clover_verify)
struct clover_round {
    int32_t m          = 0;      // positions kept (tokens emitted, an end-of-generation token included)
    int32_t n_compared = 0;      // drafts compared with the causal outputs
    int32_t n_accepted = 0;      // drafts accepted
    bool    hit_eog    = false;  // a_m is an end-of-generation token
};

// a target's token and its confidence P(token) at temperature 1
struct clover_choice {
    llama_token token;
    float       conf;
};

double      clover_now_ms();
void        clover_histogram_add(int32_t * histogram, int32_t value);

// batches and passes (clover-decode.cpp)
void clover_batch_clear(llama_batch & batch);
void clover_batch_add(llama_batch & batch, llama_token token, llama_pos pos, llama_seq_id seq, bool logits);
// a causal pass appends to the history (seq_history); a block pass reads a scratch copy of it (seq_scratch) and
// never writes the history. `what` names the pass in an error.
bool clover_causal(clover_slot * slot, const llama_token * tokens, int32_t n, const std::vector<int32_t> & rows,
                   const char * what);
bool clover_block(clover_slot * slot, const std::vector<llama_token> & window, const std::vector<int32_t> & rows);
// the logits of output row i (the distribution stage adjusts them in place)
float * clover_get_row(clover_slot * slot, int32_t i);

// the decoding loops of one generate call (clover-decode.cpp)
bool    clover_timed_block(clover_run & run, const std::vector<llama_token> & window, const std::vector<int32_t> & rows);
void    clover_window(const clover_run & run, const std::vector<llama_token> & canvas, std::vector<llama_token> & window);
bool    clover_verify(clover_run & run, const llama_token * drafts, int32_t n_drafts, int32_t width, clover_round & round);
bool    clover_run_ar(clover_run & run);
bool    clover_run_diffusion(clover_run & run);
bool    clover_run_spec(clover_run & run);

// distributions and the sampler (spec 4; clover-sampling.cpp)
llama_token   clover_argmax(const clover_sampler & smp, const float * logits, int32_t n_vocab);
float         clover_prob(const clover_sampler & smp, const float * logits, int32_t n_vocab, llama_token token, float max_v);
// the token for one target (greedy: argmax P; else a draw from Q) and its confidence P(token)
clover_choice clover_choose(const clover_slot * slot, clover_sampler & smp, const float * logits);
// the token of one verified target and whether its draft was accepted (draft < 0: none), after the distribution
// stage (which it applies to logits); -1 when nothing is allowed
llama_token   clover_accept(clover_run & run, float * logits, llama_token draft, bool & accepted);
// a GBNF grammar parses against the vocabulary and allows some token at its start (NULL or "" root = "root");
// 0, or -1 with a message
int32_t       clover_check_grammar(const llama_vocab * vocab, const char * grammar, const char * root,
                                   const std::vector<uint8_t> & excluded, std::string & err);
// The distribution stage (spec 4): adds the bias, applies the penalties and, with full_grammar, sets what the
// grammar forbids to -inf, in place on one target's logits. Without full_grammar the grammar is left to
// clover_dist_argmax, which checks only the winner (llama.cpp's common_sampler does the same).
void          clover_dist_apply(clover_run & run, float * logits, bool full_grammar);
// argmax P of adjusted logits under the grammar; -1 when the grammar allows no token (slot->last_error says so)
llama_token   clover_dist_argmax(clover_run & run, float * logits);
// whether logits need the grammar's full mask (sampling or logprobs) rather than clover_dist_argmax's check
bool          clover_dist_needs_mask(const clover_run & run);
// a produced response token, in order: the penalties count it and the grammar advances over it
void          clover_dist_produce(clover_run & run, llama_token token);
// count (+1) or uncount (-1) a token for the penalties only (a window's known targets, spec 4)
void          clover_dist_count(clover_run & run, llama_token token, int32_t delta);
// log P of token, and the top alternatives, of adjusted logits (the excluded ids and -inf ones have none)
clover_logprob clover_dist_logprob(const clover_run & run, const float * logits, llama_token token);
// bias, penalties (the call's, else the GGUF's), grammar and logprobs of a call; false with a message
bool          clover_init_dist(const clover_slot * slot, const clover_gen_params * params,
                               const std::vector<uint8_t> & excluded, clover_dist & dist, std::string & err);

// banned and stop ids, temperature, top-k/p and the seeded RNG
bool          clover_init_sampler(const clover_slot * slot, const clover_gen_params * params, clover_sampler & smp,
                                  std::string & err);

// a generate call (clover-params.cpp): the run its parameters describe (nothing is touched on failure), the prompt's
// prefill, and the mode's loop
bool clover_run_init(clover_slot * slot, const clover_gen_params * params, clover_run & run, const llama_token * prompt,
                     int32_t n_prompt, std::string & err);
bool clover_prefill(clover_slot * slot, const llama_token * prompt, int32_t n_prompt, clover_stats * stats);
bool clover_dispatch(clover_run & run);

// prefix cache (clover-cache.cpp)
bool    clover_cache_save(clover_slot * slot);                       // a checkpoint at n_past (false: none taken)
int32_t clover_cache_next_due(const clover_slot * slot);             // the next n_past a prefill checkpoints at, or -1
void    clover_cache_forget_after(clover_slot * slot, int32_t keep);   // drop checkpoints past the history
bool    clover_cache_rewind(clover_slot * slot);                     // back to the latest checkpoint
void    clover_cache_forget_all(clover_slot * slot);                 // no checkpoint, hint or rewind left

// slots (clover-parallel.cpp)
// with n_parallel > 1: the lock and the queue the engine's slots share, and the batch of their rounds
void clover_share_context(clover_engine & engine, int32_t n_ubatch);
// with a shared context: queue the slot's batch (slot->batch; a block window when `block`) and return after a round
// ran it; its logits are then read with clover_get_row. The caller holds the slot's lock (clover_slot_guard).
int32_t clover_parallel_pass(clover_slot * slot, bool block);
// run `fn` (a llama_decode outside the rounds) on the decode thread when the slot's context is shared, else here
int32_t clover_shared_call(clover_slot * slot, const std::function<int32_t()> & fn);
// run a block window (the batch on seq_scratch) for one slot: copy the history to the scratch sequence, decode
// without the causal mask, drop the scratch sequence
int32_t clover_block_decode_seqs(llama_context * ctx, const llama_batch & batch, const llama_seq_id * history,
                                 const llama_seq_id * scratch, int32_t n_slots);

// Holds a slot's share of the engine for one C API call (no-op with one slot); `generating` marks the slot as one
// whose passes a round waits for.
class clover_slot_guard {
  public:
    clover_slot_guard(clover_slot * slot, bool generating);
    ~clover_slot_guard();
    clover_slot_guard(const clover_slot_guard &) = delete;
    clover_slot_guard & operator=(const clover_slot_guard &) = delete;

  private:
    clover_slot *                slot_;
    bool                         generating_;
    std::unique_lock<std::mutex> lock_;
};

// Releases a slot's share of the engine while a callback runs (other slots go on with their bookkeeping; a round
// still waits for this slot's next pass); no-op with one slot.
class clover_callback_scope {
  public:
    explicit clover_callback_scope(clover_slot * slot) : lock_(slot->lock) {
        if (lock_) {
            lock_->unlock();
        }
    }
    ~clover_callback_scope() {
        if (lock_) {
            lock_->lock();
        }
    }
    clover_callback_scope(const clover_callback_scope &) = delete;
    clover_callback_scope & operator=(const clover_callback_scope &) = delete;

  private:
    std::unique_lock<std::mutex> * lock_;
};

// auto mode (clover-auto.cpp)
bool clover_run_auto(clover_run & run);
bool clover_measure_costs(clover_slot * slot, clover_pass_costs & out);

// offload options (clover-offload.cpp): the llama_model_params fields that -ot, --cpu-moe, --n-cpu-moe, -sm, -mg
// and -ts set, with the pattern strings they point to; apply() is valid while this object lives
struct clover_offload {
    std::list<std::string>                         patterns;   // stable addresses for overrides[i].pattern
    std::vector<llama_model_tensor_buft_override>  overrides;  // {nullptr, nullptr}-terminated, or empty
    std::vector<float>                             tensor_split;  // llama_max_devices() entries, or empty
    llama_split_mode split_mode = LLAMA_SPLIT_MODE_LAYER;
    int32_t          main_gpu   = 0;

    clover_offload() = default;
    clover_offload(const clover_offload &) = delete;  // overrides point into patterns
    clover_offload & operator=(const clover_offload &) = delete;
    clover_offload & operator=(clover_offload &&) = default;  // std::list keeps its nodes (and c_str()s) on move

    void apply(llama_model_params & mp) const;
};

// everything clover_engine_load hands to llama.cpp, resolved from the engine params and the GGUF header
// (clover-params.cpp); mparams points into offload, so a plan is not copied
struct clover_load_plan {
    clover_model_info    info = {};
    std::string          bd_path;  // the block-diffusion sidecar, or empty
    int32_t              max_block = 0;
    int32_t              n_ctx     = 0;
    int32_t              n_batch   = 0;
    int32_t              n_parallel = 1;
    int32_t              n_graph_cache = 0;
    int32_t              prefill_chunk = 0;
    clover_offload       offload;
    llama_model_params   mparams = {};
    llama_context_params cparams = {};

    clover_load_plan() = default;
    clover_load_plan(const clover_load_plan &) = delete;
    clover_load_plan & operator=(const clover_load_plan &) = delete;
};

// the plan of a load with these params; false with a message naming what is wrong
bool clover_make_load_plan(const char * path, const clover_engine_params & params, clover_load_plan & plan,
                           std::string & err);
// the engine of a plan: model, context and slots; nullptr with a message, and nothing left allocated
std::unique_ptr<clover_engine> clover_engine_make(const char * path, const clover_engine_params & params,
                                                  clover_load_plan & plan, std::string & err);

// false with a message naming the option (its engine-params field and llama.cpp's flag) when it cannot be satisfied
bool    clover_offload_resolve(const clover_engine_params & p, int32_t n_layer, clover_offload & out, std::string & err);
// the GPU devices (discrete and integrated) of the backend registry
int32_t clover_n_gpu_devices();
// false with a message naming -np when the host entry's context and compute buffers exceed its free memory less
// the margin
bool    clover_check_host_fit(const std::vector<clover_device_memory> & devs, int32_t margin_mib, int32_t n_parallel,
                              std::string & err);
// per-device memory of a load with these params, from llama.cpp's no_alloc dry run; the host entry is last
bool    clover_plan_memory(const char * path, const llama_model_params & mparams, const llama_context_params & cparams,
                           std::vector<clover_device_memory> & out, std::string & err);

// GGUF headers (clover-gguf.cpp)
// general.architecture is one of spec v2's spellings (clover_moe, clover-moe, clovermoe); else false and a message
// (the retired v1 'clover' gets one that names v2)
bool    clover_check_arch(const char * path, const std::string & arch, std::string & err);
// the clover settings of a model file, and of its block-diffusion sidecar when bd_path is not NULL or empty;
// false with a message naming the file and the key
bool    clover_read_info(const char * path, const char * bd_path, clover_model_info & info, std::string & err);
// <arch>.block_count of a GGUF, or -1 with a message
int32_t clover_gguf_n_layer(const char * path, std::string & err);
