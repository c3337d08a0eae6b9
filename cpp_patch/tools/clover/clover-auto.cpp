// Auto mode (docs/decoding.md, "auto"): each round verifies the draft that llama.cpp's speculative framework
// (common/speculative.h) makes for the slot's sequence, or none. The drafters and the policy are the ones
// llama-server runs with `--spec-type ngram-mod,draft-clover`, so each has one implementation:
//   - ngram-mod first: the continuation of the last n_match tokens, where the history holds one;
//   - else draft-clover: the model's own block pass (spec 4.2), behind the n-gram drafter a gated one, taken
//     while the measured time per emitted token of rounds with a block draft beats that of rounds without a draft,
//     and probed now and then the other way.
// The verification is llama-server's as well (clover_verify: common_sampler_sample_and_accept_n on the call's
// common_sampler, with its grammar and its penalties over the response). Every emitted token comes out of a causal
// verification, so greedy auto equals greedy ar and sampled auto keeps ar's distribution (a draft is accepted with
// probability Q(d)). The policy follows measured times, so a sampled run's text may differ from run to run for one
// seed.
//
// A draft is at most what the call's remaining tokens and the context leave; an n-gram draft is as long as its drafter
// makes it (ngram-mod: 48 to 64 tokens), a block draft B - 1 at most (the call's block_size, the engine's
// max_block_size). A verification that rejects more positions than the recurrent state rolls back (n_rs_seq =
// max_block_size - 1) restores the state from before it and replays the kept tokens (clover_verify), as llama-server
// restores its speculative checkpoint.

#include "clover-auto.h"
#include "clover-decode.h"
#include "clover-log.h"
#include "clover-parallel.h"
#include "clover-run.h"
#include "clover-slot.h"

#include <algorithm>
#include <exception>

namespace {

// the engine's drafters (NULL with last_error set if they could not be made)
common_speculative * clover_auto_drafter(clover_slot * slot) {
    const clover_drafter & d = *slot->drafter;
    if (!d.spec) {
        slot->last_error = clover_format("auto mode: %s", d.error.c_str());
    }
    return d.spec.get();
}

// The framework's draft for the slot's sequence, at most n_max tokens (n_max_block from a block pass), and its kind.
// With slots sharing the context, the decode thread drafts for every slot waiting on a draft in one framework call
// (clover_parallel_draft).
clover_draft_kind clover_auto_draft(clover_run & run, common_speculative * spec, int32_t n_max, int32_t n_max_block,
                                    llama_tokens & draft) {
    clover_slot * slot = run.slot;
    draft.clear();
    if (n_max < 1) {
        return CLOVER_DRAFT_NONE;
    }
    const int32_t reused = llama_perf_context(slot->ctx).n_reused;
    const double  t0     = clover_now_ms();
    bool block = false;
    if (slot->shared && slot->lock) {
        block = clover_parallel_draft(slot, n_max, draft);
    } else {
        clover_draft_ask(spec, slot, n_max, draft);
        common_speculative_draft(spec);
        block = clover_draft_settle(spec, slot, draft);
    }
    if (!block) {
        return draft.empty() ? CLOVER_DRAFT_NONE : CLOVER_DRAFT_NGRAM;
    }
    run.stats->t_block_ms += clover_now_ms() - t0;
    run.stats->n_block_passes++;
    run.stats->n_graph_reuses += llama_perf_context(slot->ctx).n_reused - reused;
    draft.resize(std::min<size_t>(draft.size(), (size_t) std::max(0, n_max_block)));
    return draft.empty() ? CLOVER_DRAFT_NONE : CLOVER_DRAFT_BLOCK;
}

} // namespace

void clover_draft_ask(common_speculative * spec, const clover_slot * slot, int32_t n_max, llama_tokens & draft) {
    common_speculative_draft_params & dp = common_speculative_get_draft_params(spec, slot->seq_history);
    dp.drafting = true;
    dp.n_max    = n_max;
    dp.pos0     = slot->n_past;
    dp.id_last  = slot->pending;
    dp.prompt   = &slot->history;
    dp.result   = &draft;
    dp.pos_end  = slot->n_ctx;  // the slot's share of the engine's unified cache: a block window stays inside it
}

bool clover_draft_settle(common_speculative * spec, const clover_slot * slot, const llama_tokens & draft) {
    common_speculative_get_draft_params(spec, slot->seq_history).result = nullptr;
    return !draft.empty() &&
           common_speculative_last_type(spec, slot->seq_history) == COMMON_SPECULATIVE_TYPE_DRAFT_CLOVER;
}

void clover_drafter_init(clover_drafter & d, llama_context * ctx, int32_t n_seq, bool can_block) {
    common_params_speculative params;
    params.types = { COMMON_SPECULATIVE_TYPE_NGRAM_MOD };
    if (can_block) {
        params.types.push_back(COMMON_SPECULATIVE_TYPE_DRAFT_CLOVER);
    }
    params.draft.ctx_tgt = ctx;
    try {
        d.spec.reset(common_speculative_init(params, (uint32_t) n_seq));
    } catch (const std::exception & e) {
        d.error = e.what();
    }
    if (!d.spec && d.error.empty()) {
        d.error = "llama.cpp's speculative framework made no drafter";
    }
}

bool clover_run_auto(clover_run & run) {
    clover_slot * slot = run.slot;
    common_speculative * spec = clover_auto_drafter(slot);
    if (!spec) {
        return false;
    }
    const llama_seq_id seq = slot->seq_history;  // its coreset top_p is the call's (clover_run_init), which
                                                 // draft-clover's block passes copy to the scratch sequence
    common_speculative_begin(spec, seq, slot->history);

    llama_tokens draft;
    while (run.remaining() > 0) {
        if (slot->n_ctx - slot->n_past < 1) {
            run.stats->stop_reason = CLOVER_STOP_CONTEXT;
            break;
        }
        const int32_t rows = std::min({ slot->n_ctx - slot->n_past, run.remaining(), slot->batch_cap });
        const int32_t rows_block = std::min({ rows, run.block_size, slot->max_block_size });
        const clover_draft_kind kind = clover_auto_draft(run, spec, rows - 1, rows_block - 1, draft);
        const int32_t n = (int32_t) draft.size();
        clover_round round;
        if (!clover_verify(run, draft.data(), n, n + 1, round)) {
            return false;
        }
        if (n > 0) {
            common_speculative_accept(spec, seq, (uint16_t) round.n_accepted);
        }
        run.stats->auto_rounds[kind]++;
        run.stats->auto_drafted  += round.n_compared;
        run.stats->auto_accepted += round.n_accepted;
        if (kind == CLOVER_DRAFT_BLOCK) {
            run.stats->auto_accepted_block += round.n_accepted;
        }
        clover_histogram_add(run.stats->accepted_lengths, round.m);
        if (round.hit_eog) {
            run.stats->stop_reason = CLOVER_STOP_EOG;
            break;
        }
    }
    if (run.stats->stop_reason == CLOVER_STOP_NONE) {
        run.stats->stop_reason = CLOVER_STOP_LENGTH;
    }
    return true;
}
