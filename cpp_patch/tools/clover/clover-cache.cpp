// Prefix reuse for the Clover engine (docs/serve.md, "Prefix reuse").
//
// The history's attention KV entries can be cut at any position (llama_memory_seq_rm), but a Gated DeltaNet
// state cannot be truncated: it is restored from a checkpoint, a copy of the history's recurrent state taken
// with llama.cpp's partial sequence state (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: recurrent part only, the same
// tool llama-server's context checkpoints use). Checkpoints lie along the current history, so a checkpoint at
// n_past stays valid as long as the history keeps its first n_past positions.

#include "clover-cache.h"
#include "clover-log.h"
#include "clover-parallel.h"
#include "clover-slot.h"

#include <algorithm>

bool clover_state_save(clover_slot * slot, std::vector<uint8_t> & state) {
    const size_t size = llama_state_seq_get_size_ext(slot->ctx, slot->seq_history, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    state.resize(size);
    return size > 0 && llama_state_seq_get_data_ext(slot->ctx, state.data(), size, slot->seq_history,
                                                    LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) == size;
}

bool clover_state_load(clover_slot * slot, const std::vector<uint8_t> & state, int32_t n_past) {
    const size_t read = llama_state_seq_set_data_ext(slot->ctx, state.data(), state.size(), slot->seq_history,
                                                     LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    // the recurrent part now ends at n_past - 1, so only attention entries are removed here
    return read == state.size() && llama_memory_seq_rm(slot->mem, slot->seq_history, n_past, -1);
}

static int64_t clover_cache_bytes(const clover_slot * slot) {
    int64_t total = 0;
    for (const auto & c : slot->checkpoints) {
        total += (int64_t) c.state.size();
    }
    return total;
}

// drop least recently used checkpoints until `extra` more bytes fit the budget; false when they never can
static bool clover_cache_make_room(clover_slot * slot, int64_t extra) {
    if (extra > slot->cache_max_bytes) {
        return false;
    }
    int64_t total = clover_cache_bytes(slot);
    while (!slot->checkpoints.empty() && total + extra > slot->cache_max_bytes) {
        auto lru = std::min_element(slot->checkpoints.begin(), slot->checkpoints.end(),
                [](const clover_checkpoint & a, const clover_checkpoint & b) { return a.last_use < b.last_use; });
        total -= (int64_t) lru->state.size();
        slot->checkpoints.erase(lru);
        slot->cache_stats.n_evicted++;
    }
    return true;
}

bool clover_cache_save(clover_slot * slot) {
    if (slot->cache_max_bytes <= 0 || slot->n_past <= 0) {
        return false;
    }
    const size_t size = llama_state_seq_get_size_ext(slot->ctx, slot->seq_history, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    slot->cache_stats.checkpoint_bytes = (int64_t) size;
    // a checkpoint at the same position is replaced
    slot->checkpoints.erase(std::remove_if(slot->checkpoints.begin(), slot->checkpoints.end(),
            [&](const clover_checkpoint & c) { return c.n_past == slot->n_past; }), slot->checkpoints.end());
    if (size == 0 || !clover_cache_make_room(slot, (int64_t) size)) {
        return false;
    }
    clover_checkpoint cp;
    cp.n_past   = slot->n_past;
    cp.last_use = ++slot->cache_clock;
    if (!clover_state_save(slot, cp.state)) {
        return false;
    }
    auto at = std::upper_bound(slot->checkpoints.begin(), slot->checkpoints.end(), cp.n_past,
            [](int32_t n, const clover_checkpoint & c) { return n < c.n_past; });
    slot->checkpoints.insert(at, std::move(cp));
    slot->cache_stats.n_saved++;
    return true;
}

int32_t clover_cache_next_due(const clover_slot * slot) {
    if (slot->cache_max_bytes <= 0) {
        return -1;
    }
    int32_t due = -1;
    if (slot->checkpoint_at > slot->n_past) {
        due = slot->checkpoint_at;  // the branch point: the next prompt that shares this prefix restores here
    }
    for (int32_t hint : slot->checkpoint_hints) {
        if (hint > slot->n_past) {
            due = due < 0 ? hint : std::min(due, hint);
        }
    }
    if (slot->checkpoint_every > 0) {
        const int32_t every = (slot->n_past / slot->checkpoint_every + 1) * slot->checkpoint_every;
        due = due < 0 ? every : std::min(due, every);
    }
    return due;
}

void clover_cache_forget_after(clover_slot * slot, int32_t keep) {
    slot->checkpoints.erase(std::remove_if(slot->checkpoints.begin(), slot->checkpoints.end(),
            [keep](const clover_checkpoint & c) { return c.n_past > keep; }), slot->checkpoints.end());
}

void clover_cache_forget_all(clover_slot * slot) {
    slot->checkpoints.clear();
    slot->checkpoint_at = -1;
    slot->checkpoint_hints.clear();
    slot->rewound = false;
}

// restore the checkpoint and cut the KV entries past it; false leaves a history to be reset
static bool clover_cache_restore(clover_slot * slot, clover_checkpoint & cp) {
    if (!clover_state_load(slot, cp.state, cp.n_past)) {
        return false;
    }
    cp.last_use   = ++slot->cache_clock;
    slot->n_past   = cp.n_past;
    slot->has_pending = false;
    slot->history.resize(cp.n_past);
    clover_cache_forget_after(slot, cp.n_past);
    return true;
}

bool clover_cache_rewind(clover_slot * slot) {
    slot->rewound = !slot->checkpoints.empty() && clover_cache_restore(slot, slot->checkpoints.back());
    return slot->rewound;
}

// why the restored history sequence does not hold these tokens ("" when it does; clover_slot_set_history)
static std::string clover_history_mismatch(const clover_slot * slot, const llama_token * tokens, int32_t n_tokens) {
    std::string err;
    if (n_tokens < 0 || (n_tokens > 0 && !tokens)) {
        err = clover_format("invalid history of %d tokens", n_tokens);
    } else if (n_tokens + 1 > slot->n_ctx) {
        err = clover_format("a history of %d tokens leaves no room in the context size %d", n_tokens, slot->n_ctx);
    } else {
        for (int32_t i = 0; i < n_tokens; i++) {
            if (tokens[i] < 0 || tokens[i] >= slot->n_vocab) {
                err = clover_format("history token %d (id %d) is outside the vocabulary [0, %d)", i, tokens[i], slot->n_vocab);
                break;
            }
        }
    }
    if (err.empty()) {
        const llama_pos pmin = llama_memory_seq_pos_min(slot->mem, slot->seq_history);
        const llama_pos pmax = llama_memory_seq_pos_max(slot->mem, slot->seq_history);
        // a hybrid memory's pos_min is the recurrent part's (its one cell sits at the last position)
        const bool match = n_tokens == 0 ? pmax < 0 : (pmin >= 0 && pmax == n_tokens - 1);
        const bool scratch_empty = llama_memory_seq_pos_max(slot->mem, slot->seq_scratch) < 0;
        if (!match || !scratch_empty) {
            err = clover_format("the restored sequence holds positions [%d, %d], not the %d tokens of the history",
                                (int) pmin, (int) pmax, n_tokens);
        }
    }
    return err;
}

extern "C" {

void clover_slot_set_cache(struct clover_slot * slot, int64_t max_bytes, int32_t checkpoint_every) {
    if (!slot) {
        return;
    }
    slot->cache_max_bytes  = std::max<int64_t>(0, max_bytes);
    slot->checkpoint_every = std::max(0, checkpoint_every);
    if (slot->cache_max_bytes == 0) {
        slot->checkpoints.clear();
    } else {
        clover_cache_make_room(slot, 0);
    }
}

int32_t clover_slot_reuse_prefix(struct clover_slot * slot, const llama_token * prompt, int32_t n_prompt) {
    clover_slot_guard guard(slot, false);
    if (!slot || !prompt || n_prompt <= 1) {
        if (slot) {
            clover_slot_reset(slot);
        }
        return 0;
    }
    slot->checkpoint_hints.clear();
    slot->rewound = false;
    const int32_t limit = std::min(slot->n_past, n_prompt - 1);
    int32_t common = 0;
    while (common < limit && slot->history[common] == prompt[common]) {
        common++;
    }
    slot->checkpoint_at = common;
    if (common == slot->n_past) {
        // the prompt extends the committed history; the pending token is passed again with the prompt
        slot->has_pending = false;
        slot->cache_stats.n_reused_tokens += common;
        return common;
    }
    auto it = std::upper_bound(slot->checkpoints.begin(), slot->checkpoints.end(), common,
            [](int32_t n, const clover_checkpoint & c) { return n < c.n_past; });
    if (it != slot->checkpoints.begin() && clover_cache_restore(slot, *std::prev(it))) {
        slot->cache_stats.n_restored++;
        slot->cache_stats.n_reused_tokens += slot->n_past;
        return slot->n_past;
    }
    clover_slot_reset(slot);
    slot->checkpoint_at = common;  // no state to restore, but the next prompt may branch here again
    return 0;
}

void clover_slot_checkpoint_hint(struct clover_slot * slot, int32_t n_past) {
    if (slot && n_past > 0) {
        slot->checkpoint_hints.push_back(n_past);
    }
}

int32_t clover_slot_set_history(struct clover_slot * slot, const llama_token * tokens, int32_t n_tokens) {
    if (!slot) {
        return -1;
    }
    clover_slot_guard guard(slot, false);
    slot->last_error.clear();
    const std::string err = clover_history_mismatch(slot, tokens, n_tokens);
    if (!err.empty()) {
        clover_slot_reset(slot);
        slot->last_error = err + "; the engine was reset";
        return -1;
    }
    llama_set_causal_attn(slot->ctx, true);
    slot->n_past   = n_tokens;
    slot->has_pending = false;
    slot->pending     = 0;
    slot->history.assign(tokens, tokens + n_tokens);
    clover_cache_forget_all(slot);  // the checkpoints described the previous history
    return 0;
}

void clover_slot_cache_info(const struct clover_slot * slot, struct clover_cache_info * out) {
    if (!slot || !out) {
        return;
    }
    *out               = slot->cache_stats;
    out->n_checkpoints = (int32_t) slot->checkpoints.size();
    out->n_bytes       = clover_cache_bytes(slot);
    out->max_bytes     = slot->cache_max_bytes;
}

}
