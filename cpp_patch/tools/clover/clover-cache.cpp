// Prefix reuse for the Clover engine (docs/serve.md, "Prefix reuse").
//
// The history's attention KV entries can be cut at any position (llama_memory_seq_rm), but a Gated DeltaNet
// state cannot be truncated: it is restored from a checkpoint, a copy of the history's recurrent state taken
// with llama.cpp's partial sequence state (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: recurrent part only, the same
// tool llama-server's context checkpoints use). Checkpoints lie along the current history, so a checkpoint at
// n_past stays valid as long as the history keeps its first n_past positions.

#include "clover-impl.h"

#include <algorithm>

static int64_t clover_cache_bytes(const clover_engine * eng) {
    int64_t total = 0;
    for (const auto & c : eng->checkpoints) {
        total += (int64_t) c.state.size();
    }
    return total;
}

// drop least recently used checkpoints until `extra` more bytes fit the budget; false when they never can
static bool clover_cache_make_room(clover_engine * eng, int64_t extra) {
    if (extra > eng->cache_max_bytes) {
        return false;
    }
    int64_t total = clover_cache_bytes(eng);
    while (!eng->checkpoints.empty() && total + extra > eng->cache_max_bytes) {
        auto lru = std::min_element(eng->checkpoints.begin(), eng->checkpoints.end(),
                [](const clover_checkpoint & a, const clover_checkpoint & b) { return a.last_use < b.last_use; });
        total -= (int64_t) lru->state.size();
        eng->checkpoints.erase(lru);
        eng->cache_stats.n_evicted++;
    }
    return true;
}

bool clover_cache_save(clover_engine * eng) {
    if (eng->cache_max_bytes <= 0 || eng->n_past <= 0) {
        return false;
    }
    const size_t size = llama_state_seq_get_size_ext(eng->ctx, eng->seq_history, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    eng->cache_stats.checkpoint_bytes = (int64_t) size;
    // a checkpoint at the same position is replaced
    eng->checkpoints.erase(std::remove_if(eng->checkpoints.begin(), eng->checkpoints.end(),
            [&](const clover_checkpoint & c) { return c.n_past == eng->n_past; }), eng->checkpoints.end());
    if (size == 0 || !clover_cache_make_room(eng, (int64_t) size)) {
        return false;
    }
    clover_checkpoint cp;
    cp.n_past   = eng->n_past;
    cp.last_use = ++eng->cache_clock;
    cp.state.resize(size);
    if (llama_state_seq_get_data_ext(eng->ctx, cp.state.data(), size, eng->seq_history,
                                     LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) != size) {
        return false;
    }
    auto at = std::upper_bound(eng->checkpoints.begin(), eng->checkpoints.end(), cp.n_past,
            [](int32_t n, const clover_checkpoint & c) { return n < c.n_past; });
    eng->checkpoints.insert(at, std::move(cp));
    eng->cache_stats.n_saved++;
    return true;
}

int32_t clover_cache_next_due(const clover_engine * eng) {
    if (eng->cache_max_bytes <= 0) {
        return -1;
    }
    int32_t due = -1;
    if (eng->checkpoint_at > eng->n_past) {
        due = eng->checkpoint_at;  // the branch point: the next prompt that shares this prefix restores here
    }
    for (int32_t hint : eng->checkpoint_hints) {
        if (hint > eng->n_past) {
            due = due < 0 ? hint : std::min(due, hint);
        }
    }
    if (eng->checkpoint_every > 0) {
        const int32_t every = (eng->n_past / eng->checkpoint_every + 1) * eng->checkpoint_every;
        due = due < 0 ? every : std::min(due, every);
    }
    return due;
}

void clover_cache_forget_after(clover_engine * eng, int32_t keep) {
    eng->checkpoints.erase(std::remove_if(eng->checkpoints.begin(), eng->checkpoints.end(),
            [keep](const clover_checkpoint & c) { return c.n_past > keep; }), eng->checkpoints.end());
}

void clover_cache_forget_all(clover_engine * eng) {
    eng->checkpoints.clear();
    eng->checkpoint_at = -1;
    eng->checkpoint_hints.clear();
    eng->rewound = false;
}

// restore the checkpoint and cut the KV entries past it; false leaves a history to be reset
static bool clover_cache_restore(clover_engine * eng, clover_checkpoint & cp) {
    const size_t read = llama_state_seq_set_data_ext(eng->ctx, cp.state.data(), cp.state.size(), eng->seq_history,
                                                     LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
    if (read != cp.state.size()) {
        return false;
    }
    // the recurrent part now ends at cp.n_past - 1, so only attention entries are removed here
    if (!llama_memory_seq_rm(eng->mem, eng->seq_history, cp.n_past, -1)) {
        return false;
    }
    cp.last_use   = ++eng->cache_clock;
    eng->n_past   = cp.n_past;
    eng->has_pending = false;
    eng->history.resize(cp.n_past);
    clover_cache_forget_after(eng, cp.n_past);
    return true;
}

bool clover_cache_rewind(clover_engine * eng) {
    eng->rewound = !eng->checkpoints.empty() && clover_cache_restore(eng, eng->checkpoints.back());
    return eng->rewound;
}

extern "C" {

void clover_engine_set_cache(struct clover_engine * engine, int64_t max_bytes, int32_t checkpoint_every) {
    if (!engine) {
        return;
    }
    engine->cache_max_bytes  = std::max<int64_t>(0, max_bytes);
    engine->checkpoint_every = std::max(0, checkpoint_every);
    if (engine->cache_max_bytes == 0) {
        engine->checkpoints.clear();
    } else {
        clover_cache_make_room(engine, 0);
    }
}

int32_t clover_engine_reuse_prefix(struct clover_engine * engine, const llama_token * prompt, int32_t n_prompt) {
    clover_slot_guard guard(engine, false);
    if (!engine || !prompt || n_prompt <= 1) {
        if (engine) {
            clover_engine_reset(engine);
        }
        return 0;
    }
    clover_engine * eng = engine;
    eng->checkpoint_hints.clear();
    eng->rewound = false;
    const int32_t limit = std::min(eng->n_past, n_prompt - 1);
    int32_t common = 0;
    while (common < limit && eng->history[common] == prompt[common]) {
        common++;
    }
    eng->checkpoint_at = common;
    if (common == eng->n_past) {
        // the prompt extends the committed history; the pending token is passed again with the prompt
        eng->has_pending = false;
        eng->cache_stats.n_reused_tokens += common;
        return common;
    }
    auto it = std::upper_bound(eng->checkpoints.begin(), eng->checkpoints.end(), common,
            [](int32_t n, const clover_checkpoint & c) { return n < c.n_past; });
    if (it != eng->checkpoints.begin() && clover_cache_restore(eng, *std::prev(it))) {
        eng->cache_stats.n_restored++;
        eng->cache_stats.n_reused_tokens += eng->n_past;
        return eng->n_past;
    }
    clover_engine_reset(eng);
    eng->checkpoint_at = common;  // no state to restore, but the next prompt may branch here again
    return 0;
}

void clover_engine_checkpoint_hint(struct clover_engine * engine, int32_t n_past) {
    if (engine && n_past > 0) {
        engine->checkpoint_hints.push_back(n_past);
    }
}

int32_t clover_engine_set_history(struct clover_engine * engine, const llama_token * tokens, int32_t n_tokens) {
    if (!engine) {
        return -1;
    }
    clover_engine * eng = engine;
    clover_slot_guard guard(eng, false);
    eng->last_error.clear();
    std::string err;
    if (n_tokens < 0 || (n_tokens > 0 && !tokens)) {
        err = clover_format("invalid history of %d tokens", n_tokens);
    } else if (n_tokens + 1 > eng->n_ctx) {
        err = clover_format("a history of %d tokens leaves no room in the context size %d", n_tokens, eng->n_ctx);
    } else {
        for (int32_t i = 0; i < n_tokens; i++) {
            if (tokens[i] < 0 || tokens[i] >= eng->n_vocab) {
                err = clover_format("history token %d (id %d) is outside the vocabulary [0, %d)", i, tokens[i], eng->n_vocab);
                break;
            }
        }
    }
    if (err.empty()) {
        const llama_pos pmin = llama_memory_seq_pos_min(eng->mem, eng->seq_history);
        const llama_pos pmax = llama_memory_seq_pos_max(eng->mem, eng->seq_history);
        // a hybrid memory's pos_min is the recurrent part's (its one cell sits at the last position)
        const bool match = n_tokens == 0 ? pmax < 0 : (pmin >= 0 && pmax == n_tokens - 1);
        const bool scratch_empty = llama_memory_seq_pos_max(eng->mem, eng->seq_scratch) < 0;
        if (!match || !scratch_empty) {
            err = clover_format("the restored sequence holds positions [%d, %d], not the %d tokens of the history",
                                (int) pmin, (int) pmax, n_tokens);
        }
    }
    if (!err.empty()) {
        clover_engine_reset(eng);
        eng->last_error = err + "; the engine was reset";
        return -1;
    }
    llama_set_causal_attn(eng->ctx, true);
    eng->n_past   = n_tokens;
    eng->has_pending = false;
    eng->pending     = 0;
    eng->history.assign(tokens, tokens + n_tokens);
    clover_cache_forget_all(eng);  // the checkpoints described the previous history
    return 0;
}

void clover_engine_cache_info(const struct clover_engine * engine, struct clover_cache_info * out) {
    if (!engine || !out) {
        return;
    }
    *out               = engine->cache_stats;
    out->n_checkpoints = (int32_t) engine->checkpoints.size();
    out->n_bytes       = clover_cache_bytes(engine);
    out->max_bytes     = engine->cache_max_bytes;
}

}
