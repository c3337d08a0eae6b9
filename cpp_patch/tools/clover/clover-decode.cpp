// Passes and decoding loops of the Clover engine: causal passes on a slot's history, block passes on its scratch
// sequence, rollback; the ar, diffusion (LowConfidence) and spec loops of shared/clover-spec.md section 4. See
// docs/decoding.md for the reading of the spec that the PyTorch reference (clover_ref/decode.py) implements; in
// greedy mode this engine is token-identical to it.

#include "clover-cache.h"
#include "clover-decode.h"
#include "clover-llama.h"
#include "clover-log.h"
#include "clover-parallel.h"
#include "clover-run.h"
#include "clover-sampling.h"
#include "clover-slot.h"

#include "block-diffusion.h"  // common/: LowConfidence's rule (spec 4.1) and a block pass's rows, one implementation

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

double clover_now_ms() {
    using clock = std::chrono::steady_clock;
    return std::chrono::duration<double, std::milli>(clock::now().time_since_epoch()).count();
}

void clover_histogram_add(int32_t * histogram, int32_t value) {
    histogram[std::min(std::max(value, 0), CLOVER_HIST_SIZE - 1)]++;
}

//
// batches and passes
//

void clover_batch_clear(llama_batch & batch) {
    batch.n_tokens = 0;
}

void clover_batch_add(llama_batch & batch, llama_token token, llama_pos pos, llama_seq_id seq, bool logits) {
    const int32_t i = batch.n_tokens++;
    batch.token[i]     = token;
    batch.pos[i]       = pos;
    batch.n_seq_id[i]  = 1;
    batch.seq_id[i][0] = seq;
    batch.logits[i]    = logits;
}

// n tokens at positions pos0 .. on one sequence; logits for rows
static void clover_batch_fill(llama_batch & batch, const llama_token * tokens, int32_t n, llama_pos pos0,
                              llama_seq_id seq, const std::vector<int32_t> & rows) {
    clover_batch_clear(batch);
    for (int32_t i = 0; i < n; ++i) {
        clover_batch_add(batch, tokens[i], pos0 + i, seq, false);
    }
    for (int32_t r : rows) {
        batch.logits[r] = 1;
    }
}

static bool clover_decode(clover_slot * slot, const char * what) {
    const int32_t rc = slot->shared ? clover_parallel_pass(slot, false) : llama_decode(slot->ctx, slot->batch);
    if (rc != 0) {
        slot->last_error = clover_format("llama_decode failed in the %s (code %d)", what, rc);
        return false;
    }
    return true;
}

// causal pass appending tokens to the history (seq_history) at positions n_past ..; logits for rows
bool clover_causal(clover_slot * slot, const llama_token * tokens, int32_t n,
                          const std::vector<int32_t> & rows, const char * what) {
    if (n > slot->batch_cap) {
        slot->last_error = clover_format("internal error: a causal pass of %d tokens exceeds the batch (%d)", n, slot->batch_cap);
        return false;
    }
    clover_batch_fill(slot->batch, tokens, n, slot->n_past, slot->seq_history, rows);
    if (!clover_decode(slot, what)) {
        return false;
    }
    slot->n_past += n;
    slot->history.insert(slot->history.end(), tokens, tokens + n);
    return true;
}

// the slot's bookkeeping once its memory holds history positions [0, keep) only
static void clover_history_keep(clover_slot * slot, int32_t keep) {
    slot->n_past = std::min(slot->n_past, keep);
    slot->history.resize(slot->n_past);
    clover_cache_forget_after(slot, slot->n_past);
}

// forget history positions [keep, n_past): the recurrent state rolls back within n_rs_seq positions
static bool clover_rollback(clover_slot * slot, int32_t keep) {
    if (keep < slot->n_past && !llama_memory_seq_rm(slot->mem, slot->seq_history, keep, -1)) {
        slot->last_error = clover_format("rollback of positions %d .. %d refused (n_rs_seq = %u)",
                keep, slot->n_past - 1, llama_n_rs_seq(slot->ctx));
        return false;
    }
    clover_history_keep(slot, keep);
    return true;
}

// block pass over the window at positions n_past .. on a scratch copy of the history; logits for rows (and
// possibly a few more, see clover_block_rows). The history (seq_history) is never written.
bool clover_block(clover_slot * slot, const std::vector<llama_token> & window, const std::vector<int32_t> & rows) {
    const int32_t n = (int32_t) window.size();
    if (n > slot->max_block_size || n > slot->batch_cap) {
        slot->last_error = clover_format("internal error: a block window of %d exceeds max_block_size %d", n, slot->max_block_size);
        return false;
    }
    if (!slot->can_block) {
        slot->last_error = slot->block_unavailable;
        return false;
    }
    // the window's coreset top_p is its history's (set per call, clover_run_init; llama_clover_block_begin copies it
    // to the scratch sequence): slots with different values share a batched pass
    clover_batch_fill(slot->batch, window.data(), n, slot->n_past, slot->seq_scratch, common_block_rows(rows, n));
    const int32_t rc = slot->shared ? clover_parallel_pass(slot, true)
                                    : clover_block_decode_seqs(slot->ctx, slot->batch, &slot->seq_history, &slot->seq_scratch, 1);
    if (rc != 0) {
        slot->last_error = clover_format("llama_decode failed in the block pass (code %d)", rc);
        return false;
    }
    return true;
}

// float32 logits of batch row i (NULL with last_error set when llama.cpp has none)
float * clover_get_row(clover_slot * slot, int32_t i) {
    float * logits = nullptr;
    if (!slot->shared) {
        logits = llama_get_logits_ith(slot->ctx, i);
    } else if (i >= 0 && i < (int32_t) slot->row_of.size() && slot->row_of[i] >= 0) {
        logits = slot->rows.data() + (size_t) slot->row_of[i] * slot->n_vocab;  // copied out by the round
    }
    if (!logits) {
        slot->last_error = clover_format("llama_get_logits_ith(%d) returned no logits", i);
    }
    return logits;
}

//
// one generate call
//

// the logprobs of the n tokens being emitted (recorded in order as they were produced), to on_logprobs
static bool clover_emit_logprobs(clover_run & run, int32_t n) {
    auto & lps = run.dist.logprobs;
    bool go_on = true;
    if (run.params->on_logprobs && n > 0) {
        clover_callback_scope unlocked(run.slot);
        for (int32_t i = 0; i < n && i < (int32_t) lps.size() && go_on; ++i) {
            const clover_logprob & lp = lps[i];
            go_on = run.params->on_logprobs(lp.token, lp.logprob, lp.top_ids.data(), lp.top_logprobs.data(),
                                            (int32_t) lp.top_ids.size(), run.user_data);
        }
    }
    lps.clear();
    return go_on;
}

static bool clover_emit(clover_run & run, const llama_token * tokens, int32_t n) {
    if (n <= 0) {
        run.dist.logprobs.clear();
        return true;
    }
    run.n_out += n;
    run.stats->n_generated = run.n_out;
    bool go_on = clover_emit_logprobs(run, n);
    if (go_on && run.on_tokens) {
        clover_callback_scope unlocked(run.slot);
        go_on = run.on_tokens(tokens, n, run.user_data);
    }
    if (!go_on) {
        run.cancelled = true;
        return false;
    }
    return true;
}

// window width for the next block: B, or what is left of the context (spec 4.1); 0 ends generation
static int32_t clover_block_width(clover_run & run) {
    const int32_t width = std::min(run.block_size, run.slot->n_ctx - run.slot->n_past);
    if (width < 1) {
        run.stats->stop_reason = CLOVER_STOP_CONTEXT;
        return 0;
    }
    return width;
}

// graphs llama.cpp has reused on the slot's context so far (the last one or a kept one, n_graph_cache)
static int32_t clover_graph_reuses(const clover_run & run) {
    return llama_perf_context(run.slot->ctx).n_reused;
}

bool clover_timed_block(clover_run & run, const std::vector<llama_token> & window, const std::vector<int32_t> & rows) {
    const int32_t reused = clover_graph_reuses(run);
    const double  t0     = clover_now_ms();
    const bool    ok     = clover_block(run.slot, window, rows);
    run.stats->t_block_ms += clover_now_ms() - t0;
    run.stats->n_block_passes++;
    run.stats->n_graph_reuses += clover_graph_reuses(run) - reused;
    return ok;
}

static bool clover_timed_causal(clover_run & run, const llama_token * tokens, int32_t n, const std::vector<int32_t> & rows, const char * what) {
    const int32_t reused = clover_graph_reuses(run);
    const double  t0     = clover_now_ms();
    const bool    ok     = clover_causal(run.slot, tokens, n, rows, what);
    run.stats->t_causal_ms += clover_now_ms() - t0;
    run.stats->n_causal_passes++;
    run.stats->n_graph_reuses += clover_graph_reuses(run) - reused;
    return ok;
}

void clover_window(const clover_run & run, const std::vector<llama_token> & canvas, std::vector<llama_token> & window) {
    window = common_block_window(run.slot->pending, canvas, run.slot->info.mask_token_id);
}

// A block step's logprobs (clover_gen_params.n_logprobs): each masked target's, read from the distribution stage it was
// chosen from, kept for the targets the step fills
struct clover_step_logprobs {
    std::vector<std::pair<int32_t, clover_logprob>> targets;

    void keep(clover_run & run, const std::vector<llama_token> & canvas) {
        auto & wl = run.dist.window_logprobs;
        for (auto & [j, lp] : targets) {
            if (canvas[j] != CLOVER_EMPTY) {
                wl.resize(std::max(wl.size(), canvas.size()));
                wl[j] = std::move(lp);
            }
        }
        targets.clear();
    }
};

// the engine's block passes for common's LowConfidence step: through the slot (a shared context's round), timed
static common_block_runner clover_block_runner(clover_run & run, clover_step_logprobs & logprobs) {
    clover_slot * slot = run.slot;
    common_block_runner runner;
    runner.mask_id = slot->info.mask_token_id;
    runner.n_vocab = slot->n_vocab;
    runner.pass    = [&run](const std::vector<llama_token> & window, const std::vector<int32_t> & rows) {
        return clover_timed_block(run, window, rows);
    };
    runner.row = [slot](int32_t j) -> const float * { return clover_get_row(slot, j); };
    if (run.dist.n_logprobs >= 0) {
        runner.on_target = [&run, &logprobs](int32_t j, llama_token token, const float * stage) {
            logprobs.targets.emplace_back(j, clover_dist_logprob(run, stage, token));
        };
    }
    return runner;
}

// the canvas after a step, masked targets as the mask token, to on_step; false when the caller cancels
static bool clover_report_step(clover_run & run, const std::vector<llama_token> & canvas) {
    if (!run.on_step) {
        return true;
    }
    std::vector<llama_token> view(canvas.size());
    for (size_t j = 0; j < canvas.size(); ++j) {
        view[j] = canvas[j] == CLOVER_EMPTY ? run.slot->info.mask_token_id : canvas[j];
    }
    bool go_on = true;
    {
        clover_callback_scope unlocked(run.slot);
        go_on = run.on_step(view.data(), (int32_t) view.size(), run.user_data);
    }
    if (!go_on) {
        run.cancelled = true;
    }
    return go_on;
}

// common's block steps (spec 4.1; common/block-diffusion.h), a chain that has no token to give reported as the call's
// error
template <typename F>
static bool clover_block_steps(clover_run & run, F && steps) {
    try {
        return steps();
    } catch (const std::invalid_argument &) {  // no candidate is left (common_sampler_sample_target)
        run.slot->last_error = "logit_bias and the banned ids leave no token to generate";
        return false;
    }
}

// one LowConfidence step (common_block_diffusion_step), its logprobs and the canvas callback. Returns false on error
// or cancellation.
static bool clover_step(clover_run & run, std::vector<llama_token> & canvas) {
    clover_step_logprobs logprobs;
    const common_block_runner runner = clover_block_runner(run, logprobs);
    const bool ok = clover_block_steps(run, [&] {
        return common_block_diffusion_step(run.smp.chain.get(), runner, run.slot->pending, run.threshold, canvas);
    });
    if (!ok) {
        return false;
    }
    logprobs.keep(run, canvas);
    return clover_report_step(run, canvas);
}

bool clover_run_ar(clover_run & run) {
    while (run.remaining() > 0) {
        if (run.slot->n_past >= run.slot->n_ctx) {
            run.stats->stop_reason = CLOVER_STOP_CONTEXT;
            return true;
        }
        clover_round round;
        if (!clover_verify(run, nullptr, 0, 1, round)) {  // a width-1 verification without drafts: an ar step
            return false;
        }
        if (round.hit_eog) {
            run.stats->stop_reason = CLOVER_STOP_EOG;
            return true;
        }
    }
    run.stats->stop_reason = CLOVER_STOP_LENGTH;
    return true;
}

bool clover_run_diffusion(clover_run & run) {
    clover_slot * slot = run.slot;
    while (run.remaining() > 0) {
        const int32_t width = clover_block_width(run);
        if (width == 0) {
            return true;
        }
        clover_step_logprobs logprobs;
        const common_block_runner runner = clover_block_runner(run, logprobs);
        const auto is_stop = [&run](llama_token t) { return run.is_stop(t); };
        const auto on_step = [&](const common_block_diffusion_block & b) {
            logprobs.keep(run, b.canvas);
            return clover_report_step(run, b.canvas);
        };
        common_block_diffusion_block block;
        const bool ok = clover_block_steps(run, [&] {
            return common_block_diffusion_steps(run.smp.chain.get(), runner, slot->pending, width, run.threshold,
                                                run.remaining(), is_stop, on_step, block);
        });
        if (!ok) {
            return false;
        }
        clover_histogram_add(run.stats->steps_per_block, block.n_steps);
        const std::vector<llama_token> & canvas = block.canvas;
        const int32_t limit = block.n_produced;

        // commit: causal pass over [pending, produced[:-1]]; the last produced token becomes the pending token
        std::vector<llama_token> commit(limit);
        commit[0] = slot->pending;
        for (int32_t j = 0; j + 1 < limit; ++j) {
            commit[j + 1] = canvas[j];
        }
        if (!clover_timed_causal(run, commit.data(), limit, {}, "commit pass")) {
            return false;
        }
        slot->pending = canvas[limit - 1];
        const int32_t n_emit = block.eog ? limit - 1 : limit;
        for (int32_t j = 0; j < n_emit; ++j) {
            clover_dist_produce(run, canvas[j]);
            if (j < (int32_t) run.dist.window_logprobs.size()) {
                run.dist.logprobs.push_back(std::move(run.dist.window_logprobs[j]));
            }
        }
        run.dist.window_logprobs.clear();
        if (!clover_emit(run, canvas.data(), n_emit)) {
            return false;
        }
        if (block.eog) {
            run.stats->stop_reason = CLOVER_STOP_EOG;
            return true;
        }
    }
    run.stats->stop_reason = CLOVER_STOP_LENGTH;
    return true;
}

static bool clover_read_drafts(clover_run & run, std::vector<llama_token> & canvas, int32_t row0);

// The drafts of one block pass (spec): a pass over the canvas's window with a row per masked target, then each
// masked target in order takes the best token the grammar allows after the targets before it
// (clover_draft_grammar), from its logits through the distribution stage, the targets known at the start of the
// pass counting for the penalties (clover_window_counts). No pass when no target is masked.
static bool clover_draft_masked(clover_run & run, std::vector<llama_token> & canvas) {
    const int32_t width = (int32_t) canvas.size();
    std::vector<int32_t> masked;
    for (int32_t j = 0; j < width; ++j) {
        if (canvas[j] == CLOVER_EMPTY) {
            masked.push_back(j);
        }
    }
    if (masked.empty()) {
        return true;
    }
    std::vector<llama_token> window;
    clover_window(run, canvas, window);
    if (!clover_timed_block(run, window, masked)) {
        return false;
    }
    return clover_read_drafts(run, canvas, 0);
}

// The drafts of a block window whose rows are batch rows row0 .. row0 + width - 1 (a block pass's, or a fused pass's
// window): every empty target of canvas takes the best token of its row's P, after the known targets before it
// (penalties) and within the grammar after the drafts before it.
static bool clover_read_drafts(clover_run & run, std::vector<llama_token> & canvas, int32_t row0) {
    clover_slot * slot = run.slot;
    const int32_t width = (int32_t) canvas.size();
    std::vector<llama_token> known(canvas);  // the targets known at the start of this pass (spec 4, penalties)
    clover_window_counts counts(run, known);
    clover_draft_grammar grammar(run);       // drafts the grammar allows after the ones before (verification decides)
    for (int32_t j = 0; j < width; ++j) {
        if (known[j] != CLOVER_EMPTY) {
            grammar.known(run, known[j]);
            continue;
        }
        float * logits = clover_get_row(slot, row0 + j);
        if (!logits) {
            return false;
        }
        counts.advance(j);
        clover_dist_apply(run, logits, false);
        canvas[j] = grammar.draft(run, logits);
    }
    return true;
}

// draft: draft_steps LowConfidence steps, then one block pass where every still-masked target takes argmax P
static bool clover_draft(clover_run & run, int32_t width, std::vector<llama_token> & canvas) {
    canvas.assign(width, CLOVER_EMPTY);
    run.dist.window_logprobs.clear();  // draft steps fill it; verification reports the logprobs
    for (int32_t s = 0; s < run.params->draft_steps; ++s) {
        if (std::find(canvas.begin(), canvas.end(), CLOVER_EMPTY) == canvas.end()) {
            break;
        }
        if (!clover_step(run, canvas)) {
            return false;
        }
    }
    return clover_draft_masked(run, canvas);
}

// Verification and acceptance (spec 4.2, steps 2-4): one causal pass over [pending, drafts[0 .. width-2]] with all
// width rows; output a_j is compared with draft d_j (j <= n_drafts; a missing draft is never accepted, so all
// drafts accepted gives a_{n_drafts+1} as a free token). m = min(c+1, width, R, first end-of-generation); emits
// a_1 .. a_m but an end-of-generation token, keeps history through p+m-1, and a_m becomes the pending token. With
// width 1 and no draft this is exactly an ar step.
static bool clover_accept_rows(clover_run & run, int32_t p, const llama_token * drafts, int32_t n_drafts,
                               int32_t width, clover_round & round);

// Whether a verification pass of `width` rows may reject more positions than the recurrent state rolls back: then
// it keeps the state from before it (clover_verify), as llama-server does for such drafts
static bool clover_verify_needs_checkpoint(const clover_slot * slot, int32_t width) {
    return width - 1 > (int32_t) llama_n_rs_seq(slot->ctx);
}

// Keep history positions [0, keep) of the verification pass that began at p. Within n_rs_seq a rollback; beyond it,
// the state from before the pass comes back and a replay pass decodes the kept positions [p, keep) again (llama-server
// restores its speculative checkpoint and verifies the accepted tokens again: the same passes, one row fewer here,
// since the tokens are known).
static bool clover_keep_verified(clover_run & run, int32_t p, int32_t keep) {
    clover_slot * slot = run.slot;
    clover_checkpoint & cp = slot->verify_checkpoint;
    if (slot->n_past - keep <= (int32_t) llama_n_rs_seq(slot->ctx)) {
        cp.n_past = -1;
        return clover_rollback(slot, keep);
    }
    if (cp.n_past != p) {
        slot->last_error = clover_format("internal error: a rollback of %d positions past n_rs_seq = %u without a "
                "checkpoint", slot->n_past - keep, llama_n_rs_seq(slot->ctx));
        return false;
    }
    cp.n_past = -1;
    const std::vector<llama_token> kept(slot->history.begin() + p, slot->history.begin() + keep);
    if (!clover_state_load(slot, cp.state, p)) {
        slot->last_error = clover_format("restoring the state before a verification at position %d failed", p);
        return false;
    }
    clover_history_keep(slot, p);
    run.stats->n_replays++;
    return clover_timed_causal(run, kept.data(), (int32_t) kept.size(), {}, "replay pass");
}

bool clover_verify(clover_run & run, const llama_token * drafts, int32_t n_drafts, int32_t width, clover_round & round) {
    clover_slot * slot = run.slot;
    const int32_t p = slot->n_past;
    std::vector<llama_token> inputs(width);
    std::vector<int32_t>     rows(width);
    inputs[0] = slot->pending;
    for (int32_t j = 0; j < width; ++j) {
        rows[j] = j;
        if (j + 1 < width) {
            inputs[j + 1] = drafts[j];
        }
    }
    if (clover_verify_needs_checkpoint(slot, width)) {
        if (!clover_state_save(slot, slot->verify_checkpoint.state)) {
            slot->last_error = clover_format("saving the state before a verification of %d drafts failed", width - 1);
            return false;
        }
        slot->verify_checkpoint.n_past = p;
    }
    if (!clover_timed_causal(run, inputs.data(), width, rows, width == 1 ? "ar step" : "verification pass")) {
        return false;
    }
    return clover_accept_rows(run, p, drafts, n_drafts, width, round);
}

// The drafts a verification's rows are sampled against (clover_sample_rows): those the pass fed (one fewer than its
// rows), up to the first stop id and within the call's budget. A draft past either would end the round anyway: the
// draw at its row is the same, accepted or not, and it ends the round.
static llama_tokens clover_verified_drafts(const clover_run & run, const llama_token * drafts, int32_t n_drafts,
                                           int32_t width) {
    const int32_t n_max = std::min({ n_drafts, width - 1, run.remaining() - 1 });
    llama_tokens out;
    for (int32_t j = 0; j < n_max && !run.is_stop(drafts[j]); ++j) {
        out.push_back(drafts[j]);
    }
    return out;
}

// Acceptance (spec 4.2, steps 3-4) over the first width rows of the pass that just ran at position p: output a_j
// (row j-1) against draft d_j by llama.cpp's rule (clover_sample_rows); emits the accepted tokens, keeps history
// through p+m-1 (rolling back everything the pass wrote after it) and makes a_m the pending token. d_j with j = width
// (a spec round's last draft, fed to no row) is compared with a_width for the statistics only.
static bool clover_accept_rows(clover_run & run, int32_t p, const llama_token * drafts, int32_t n_drafts,
                               int32_t width, clover_round & round) {
    clover_slot * slot = run.slot;
    round = {};
    const llama_tokens verified = clover_verified_drafts(run, drafts, n_drafts, width);
    std::vector<float *> rows(verified.size() + 1);
    for (size_t j = 0; j < rows.size(); ++j) {
        rows[j] = clover_get_row(slot, (int32_t) j);
        if (!rows[j]) {
            return false;
        }
    }
    std::vector<llama_token> out;
    if (!clover_sample_rows(run, rows, verified, out)) {
        return false;
    }
    round.m          = (int32_t) out.size();
    round.n_accepted = round.m - 1 + (round.m <= n_drafts && drafts[round.m - 1] == out.back() ? 1 : 0);
    round.n_compared = std::min(round.m, n_drafts);
    round.hit_eog    = run.is_stop(out.back());

    // keep history through p+m-1, roll back p+m .. p+width-1; a_{p+m} is the next pending token
    if (!clover_keep_verified(run, p, p + round.m)) {
        return false;
    }
    slot->pending = out.back();
    if (round.hit_eog) {
        out.pop_back();  // a stop token is not emitted (nor its logprobs)
    }
    return clover_emit(run, out.data(), (int32_t) out.size());
}

// Whether a spec round of this width can be one fused pass (docs/native.md, "The fused pass"): the call asks for it,
// the slot decodes alone (a batched round would mix other slots' rows into the ubatch), the drafts are plain argmax
// drafts (no draft_steps), and the 2B - 1 rows fit one ubatch, the context and the recurrent rollback (a rejection at
// the first draft removes 2B - 2 rows).
static bool clover_can_fuse(const clover_run & run, int32_t width) {
    const clover_slot * slot = run.slot;
    const int32_t rows = 2 * width - 1;
    return run.params->spec_fused != 0 && width >= 2 && !slot->shared && run.params->draft_steps == 0 &&
           rows <= slot->batch_cap && rows <= (int32_t) llama_n_ubatch(slot->ctx) &&
           slot->n_past + rows <= slot->n_ctx && rows - 1 <= (int32_t) llama_n_rs_seq(slot->ctx);
}

// A fused spec round: one causal pass over [pending, d_1 .. d_{B-2}] (B - 1 rows at p ..) whose ubatch continues with
// the next round's block window [d_{B-1}, MASK x (B - 1)] at p + B - 1 ... The causal rows verify d_1 .. d_{B-1}
// (spec 4.2). When all are accepted, d_{B-1} is the pending token at p + B - 1 and the window, a block pass over
// exactly the history it would see in a round of its own, gives the next round's drafts (next, true); otherwise
// the round ends as an unfused one would at the first rejection and the window is void (next_valid false). The
// window's cells are always removed with the rolled-back rows. A round of B verifies B - 1 drafts where an unfused
// one verifies B - 1 and adds the bonus token, for one pass instead of two.
static bool clover_verify_fused(clover_run & run, const std::vector<llama_token> & drafts, int32_t width,
                                clover_round & round, std::vector<llama_token> & next, bool & next_valid) {
    clover_slot * slot = run.slot;
    const int32_t p = slot->n_past;
    const int32_t n_causal = width - 1;
    std::vector<llama_token> inputs;
    inputs.reserve(2 * width - 1);
    inputs.push_back(slot->pending);
    inputs.insert(inputs.end(), drafts.begin(), drafts.begin() + (width - 2));
    inputs.push_back(drafts[width - 2]);  // the window: its known seed, then masks
    inputs.insert(inputs.end(), width - 1, slot->info.mask_token_id);
    std::vector<int32_t> rows(inputs.size());
    for (size_t i = 0; i < rows.size(); ++i) {
        rows[i] = (int32_t) i;
    }
    // the window routes inside the history's coreset top_p (set per call, clover_run_init)
    llama_set_seq_param(slot->ctx, slot->seq_history, LLAMA_CLOVER_PARAM_FUSED_WINDOW, (float) width);
    const bool ok = clover_timed_causal(run, inputs.data(), (int32_t) inputs.size(), rows, "fused pass");
    llama_set_seq_param(slot->ctx, slot->seq_history, LLAMA_CLOVER_PARAM_FUSED_WINDOW, NAN);
    if (!ok) {
        return false;
    }
    run.stats->n_fused_passes++;
    // every accepted draft leaves the history at p + width - 2 at most: the window is removed in any case
    if (!clover_accept_rows(run, p, drafts.data(), n_causal, n_causal, round)) {
        return false;
    }
    next_valid = round.m == n_causal && round.n_accepted == n_causal && !round.hit_eog && run.remaining() > 0;
    if (!next_valid) {
        return true;
    }
    next.assign(width, CLOVER_EMPTY);
    run.dist.window_logprobs.clear();
    return clover_read_drafts(run, next, n_causal);
}

bool clover_run_spec(clover_run & run) {
    std::vector<llama_token> drafts;
    bool have_drafts = false;  // drafts hold the window a fused pass drafted for this round
    bool last_full   = false;  // the last round accepted every draft
    while (run.remaining() > 0) {
        const int32_t width = clover_block_width(run);
        if (width == 0) {
            return true;
        }
        // a fused pass pays only when its window is used, so rounds fuse while every draft is accepted; the round
        // after a rejection is an unfused one (a block pass and a verification, with its free token)
        const bool fuse = clover_can_fuse(run, width) && (have_drafts || last_full);
        if (!(fuse && have_drafts && (int32_t) drafts.size() == width) && !clover_draft(run, width, drafts)) {
            return false;
        }
        clover_round round;
        if (fuse) {
            std::vector<llama_token> next;
            if (!clover_verify_fused(run, drafts, width, round, next, have_drafts)) {
                return false;
            }
            drafts.swap(next);
            last_full = have_drafts;
        } else {
            have_drafts = false;
            if (!clover_verify(run, drafts.data(), width, width, round)) {
                return false;
            }
            last_full = round.n_accepted >= width - 1;
        }
        clover_histogram_add(run.stats->accepted_lengths, round.m);
        if (round.hit_eog) {
            run.stats->stop_reason = CLOVER_STOP_EOG;
            return true;
        }
    }
    run.stats->stop_reason = CLOVER_STOP_LENGTH;
    return true;
}
