// The C API of the Clover decoding engine (clover.h): ar, LowConfidence block diffusion and self-speculative decoding
// (shared/clover-spec.md section 4). The work is done in the other translation units, listed below;
// this file checks the arguments, holds a slot's share of the engine for each call, and keeps the deprecated names.
//
// libclover's files, and the internal header (not part of the C API) that declares what each one shares:
//
//   clover.cpp           the C API of the engine and its slots (extern "C"), and the deprecated names
//   clover-slot.h        a slot (one history) and the engine that owns the slots, which every part reads
//   clover-run.h         one generate call's state: its sampler, its distribution stage and the run
//   clover-params.cpp    the load plan and the load; a generate call's parameter checks, prefill and dispatch
//                        (clover-params.h)
//   clover-decode.cpp    batches and passes; the ar, diffusion and spec loops (clover-decode.h)
//   clover-sampling.cpp  distributions and the sampler (spec 4), drafts under the grammar (clover-sampling.h)
//   clover-auto.cpp      auto mode: common/speculative's drafters, libclover's verification (clover-auto.h)
//   clover-costs.cpp     what a slot's passes cost (clover-costs.h)
//   clover-cache.cpp     the prefix cache (and its clover_slot_* functions) (clover-cache.h)
//   clover-parallel.cpp  slots sharing one context, their passes batched in rounds (clover-parallel.h)
//   clover-offload.cpp   offload options, the memory plan, the fit checks, devices, RPC servers (clover-offload.h)
//   clover-gguf.cpp      the clover settings and other header reads of a GGUF (clover-gguf.h)
//   clover-threads.cpp   the default thread count (clover.h)
//   clover-log.cpp       messages through llama.cpp's log callback (clover-log.h)
//   clover-imatrix.cpp   the importance-matrix collector (clover-imatrix.h, a C API of its own)
//   clover-llama.h       the clover model's C functions in libllama

#include "clover.h"
#include "clover-auto.h"
#include "clover-costs.h"
#include "clover-cache.h"
#include "clover-gguf.h"
#include "clover-log.h"
#include "clover-offload.h"
#include "clover-parallel.h"
#include "clover-params.h"
#include "clover-run.h"
#include "clover-sampling.h"
#include "clover-slot.h"

#include "ggml-backend.h"
#include "llama.h"
#include "json-schema-to-grammar.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <stdexcept>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

static const clover_slot * clover_first_slot(const clover_engine * engine) {
    return engine && !engine->slots.empty() ? engine->slots[0].get() : nullptr;
}

// a cancelled or failed generate call: back to where the answer started (its prompt stays reusable) or a fresh
// history after a cancellation; a reset after a failure. Returns what clover_slot_generate returns.
static int32_t clover_generate_end(clover_slot * slot, const clover_run & run, bool ok, clover_stats * stats) {
    stats->n_generated = run.n_out;
    if (run.cancelled) {
        if (!clover_cache_rewind(slot)) {
            clover_slot_reset(slot);
        }
        stats->stop_reason = CLOVER_STOP_CANCELLED;
        return run.n_out;
    }
    if (!ok) {
        slot->last_error = (slot->last_error.empty() ? std::string("generation failed") : slot->last_error) + "; the engine was reset";
        clover_slot_reset(slot);
        return -1;
    }
    return run.n_out;
}

extern "C" {

//
// the GGUF's settings
//

int32_t clover_model_info_read(const char * path, const char * bd_path, struct clover_model_info * info, char * err,
                               size_t err_size) {
    if (!info) {
        clover_set_err(err, err_size, "info is NULL");
        return -1;
    }
    std::string msg;
    if (!clover_read_info(path, bd_path, *info, msg)) {
        clover_set_err(err, err_size, msg);
        return -1;
    }
    clover_set_err(err, err_size, "");
    return 0;
}

float clover_model_info_threshold(const struct clover_model_info * info, int32_t block_size) {
    for (int32_t i = 0; i < info->n_calibrated; ++i) {
        if (info->calibrated_block_sizes[i] == block_size) {
            return info->calibrated_thresholds[i];
        }
    }
    return info->threshold;
}

int32_t clover_block_decode(struct llama_context * ctx, const struct llama_batch * batch) {
    if (!ctx || !batch) {
        return -1;
    }
    const llama_seq_id history = 0;  // a single-slot engine's sequences
    const llama_seq_id scratch = 1;
    return clover_block_decode_seqs(ctx, *batch, &history, &scratch, 1);
}

struct clover_engine_params clover_engine_default_params(void) {
    clover_engine_params p = {};
    p.n_ctx           = 0;
    p.n_batch         = 512;
    p.max_block_size  = 0;
    p.n_threads       = 0;
    p.n_gpu_layers    = 0;
    p.use_extra_bufts = true;
    p.override_tensor = nullptr;
    p.n_cpu_moe       = 0;
    p.cpu_moe         = false;
    p.split_mode      = -1;
    p.main_gpu        = 0;
    p.tensor_split    = nullptr;
    p.fit_margin_mib  = 1024;
    p.n_parallel      = 1;
    p.bd_path         = nullptr;
    p.n_prefill_chunk = 128;
    p.n_graph_cache   = -1;
    return p;
}

struct clover_gen_params clover_gen_default_params(void) {
    clover_gen_params p = {};
    p.mode         = CLOVER_MODE_AUTO;
    p.block_size   = 0;
    p.threshold    = -1.0f;
    p.draft_steps  = 0;
    p.temperature  = 0.0f;
    p.top_k        = 0;
    p.top_p        = 1.0f;
    p.seed         = 0;
    p.max_tokens   = 64;
    p.stop_ids     = nullptr;
    p.n_stop_ids   = -1;
    p.banned_ids   = nullptr;
    p.n_banned_ids = 0;
    p.coreset_top_p = 0.0f;
    p.bias_ids          = nullptr;
    p.bias_values       = nullptr;
    p.n_bias            = 0;
    p.repeat_penalty    = NAN;  // the GGUF's
    p.presence_penalty  = NAN;
    p.frequency_penalty = NAN;
    p.grammar           = nullptr;
    p.grammar_root      = nullptr;
    p.grammar_after_ids   = nullptr;
    p.n_grammar_after_ids = 0;
    p.n_logprobs        = -1;
    p.on_logprobs       = nullptr;
    p.spec_fused        = 0;
    return p;
}

//
// the engine
//

struct clover_engine * clover_engine_load(const char * path, struct clover_engine_params params,
                                          char * err, size_t err_size) {
    clover_load_plan plan;
    std::string msg;
    std::unique_ptr<clover_engine> engine;
    if (clover_make_load_plan(path, params, plan, msg)) {
        engine = clover_engine_make(path, params, plan, msg);
    }
    if (!engine) {
        clover_set_err(err, err_size, msg);
        return nullptr;
    }
    clover_set_err(err, err_size, "");
    return engine.release();
}

void clover_engine_free(struct clover_engine * engine) {
    delete engine;  // the slots first, then the context, then the model
}

int32_t clover_engine_describe_offload(const char * path, struct clover_engine_params params,
                                       char * out, size_t out_size, char * err, size_t err_size) {
    clover_load_plan plan;
    std::string msg;
    if (!clover_make_load_plan(path, params, plan, msg)) {
        clover_set_err(err, err_size, msg);
        return -1;
    }
    const llama_model_params & mp = plan.mparams;
    std::string text = clover_format("n_gpu_layers=%d\nsplit_mode=%d\nmain_gpu=%d\n", mp.n_gpu_layers,
                                     (int) mp.split_mode, mp.main_gpu);
    text += "tensor_split=";
    for (size_t i = 0; mp.tensor_split && i < llama_max_devices(); ++i) {
        text += clover_format("%s%g", i ? "," : "", mp.tensor_split[i]);
    }
    text += "\n";
    for (const auto * o = mp.tensor_buft_overrides; o && o->pattern; ++o) {
        text += std::string("override=") + o->pattern + "=" + ggml_backend_buft_name(o->buft) + "\n";
    }
    if (text.size() + 1 > out_size) {
        clover_set_err(err, err_size, clover_format("the description needs %zu bytes", text.size() + 1));
        return -1;
    }
    clover_set_err(out, out_size, text);
    clover_set_err(err, err_size, "");
    return 0;
}

int32_t clover_engine_plan_memory(const char * path, struct clover_engine_params params,
                                  struct clover_device_memory * out, int32_t n_out, char * err, size_t err_size) {
    clover_load_plan plan;
    std::string msg;
    std::vector<clover_device_memory> devs;
    if (!clover_make_load_plan(path, params, plan, msg) || !clover_plan_memory(path, plan.mparams, plan.cparams, devs, msg)) {
        clover_set_err(err, err_size, msg);
        return -1;
    }
    const int32_t n = std::min((int32_t) devs.size(), std::max(n_out, 0));
    for (int32_t i = 0; out && i < n; ++i) {
        out[i] = devs[i];
    }
    clover_set_err(err, err_size, "");
    return n;
}

const struct clover_model_info * clover_engine_info(const struct clover_engine * engine) {
    const clover_slot * first = clover_first_slot(engine);
    return first ? &first->info : nullptr;
}

struct clover_slot * clover_engine_slot(struct clover_engine * engine, int32_t i) {
    if (!engine || i < 0 || i >= (int32_t) engine->slots.size()) {
        return nullptr;
    }
    return engine->slots[i].get();
}

int32_t clover_engine_n_parallel(const struct clover_engine * engine) {
    return engine ? (int32_t) engine->slots.size() : 0;
}

void clover_engine_pass_stats(const struct clover_engine * engine, int64_t * n_passes, int64_t * n_rounds) {
    const clover_slot * first = clover_first_slot(engine);
    if (first && first->shared) {
        *n_passes = first->shared->n_passes.load();
        *n_rounds = first->shared->n_rounds.load();
    } else {
        *n_passes = 0;
        *n_rounds = 0;
    }
}

void clover_engine_block_pass_stats(const struct clover_engine * engine, int64_t * n_passes, int64_t * n_rounds) {
    const clover_slot * first = clover_first_slot(engine);
    const bool shared = first && first->shared;
    *n_passes = shared ? first->shared->n_block_passes.load() : 0;
    *n_rounds = shared ? first->shared->n_block_rounds.load() : 0;
}

struct llama_model * clover_engine_model(struct clover_engine * engine) {
    return engine ? engine->model.get() : nullptr;
}

struct llama_context * clover_engine_context(struct clover_engine * engine) {
    return engine ? engine->ctx.get() : nullptr;
}

int32_t clover_engine_n_ctx(const struct clover_engine * engine) {
    const clover_slot * first = clover_first_slot(engine);
    return first ? first->n_ctx : 0;
}

int32_t clover_engine_max_block_size(const struct clover_engine * engine) {
    const clover_slot * first = clover_first_slot(engine);
    return first ? first->max_block_size : 0;
}

int32_t clover_engine_n_threads(const struct clover_engine * engine) {
    return engine ? (int32_t) llama_n_threads(engine->ctx.get()) : 0;
}

int32_t clover_engine_check_grammar(const struct clover_engine * engine, const char * grammar, const char * root,
                                    char * err, size_t err_size) {
    std::string msg;
    if (!engine || !grammar) {
        msg = "no engine or no grammar given";
    } else {
        const llama_vocab * vocab = llama_model_get_vocab(engine->model.get());
        std::vector<uint8_t> excluded(llama_vocab_n_tokens(vocab), 0);
        const clover_slot * first = clover_first_slot(engine);
        if (first && first->info.mask_token_id >= 0) {
            excluded[first->info.mask_token_id] = 1;
        }
        if (clover_check_grammar(vocab, grammar, root, excluded, msg) == 0) {
            return 0;
        }
    }
    clover_set_err(err, err_size, msg);
    return -1;
}

static constexpr size_t CLOVER_SCHEMA_MAX_KEYS = 1024;  // in one object of a JSON schema

// Refuses, before common_json parses it, a schema text with an object of more than CLOVER_SCHEMA_MAX_KEYS keys:
// common_json keeps the order of an object's keys and finds each new one by a linear search, so parsing an object
// of n keys costs n^2 / 2 comparisons (a 16 MB schema of one object took minutes). A SAX pass, no tree: linear.
static void clover_check_schema_objects(const char * text) {
    struct counter : nlohmann::json_sax<nlohmann::json> {
        std::vector<size_t> keys;  // per open object (arrays: not counted)
        bool too_many = false;

        bool null() override { return true; }
        bool boolean(bool) override { return true; }
        bool number_integer(number_integer_t) override { return true; }
        bool number_unsigned(number_unsigned_t) override { return true; }
        bool number_float(number_float_t, const string_t &) override { return true; }
        bool string(string_t &) override { return true; }
        bool binary(binary_t &) override { return true; }
        bool start_object(std::size_t) override { keys.push_back(0); return true; }
        bool end_object() override { keys.pop_back(); return true; }
        bool start_array(std::size_t) override { keys.push_back(SIZE_MAX); return true; }
        bool end_array() override { keys.pop_back(); return true; }
        bool key(string_t &) override {
            too_many = ++keys.back() > CLOVER_SCHEMA_MAX_KEYS;
            return !too_many;
        }
        bool parse_error(std::size_t, const std::string &, const nlohmann::detail::exception &) override {
            return false;  // common_json's parse names the error
        }
    } sax;
    nlohmann::json::sax_parse(text, &sax);
    if (sax.too_many) {
        throw std::invalid_argument("an object holds more than " + std::to_string(CLOVER_SCHEMA_MAX_KEYS) +
                                    " keys (the limit)");
    }
}

int32_t clover_json_schema_to_grammar(const char * schema_json, char * out, size_t out_size, char * err,
                                      size_t err_size) {
    std::string msg;
    try {
        if (!schema_json) {
            throw std::invalid_argument("no schema given");
        }
        clover_check_schema_objects(schema_json);
        const common_json schema = common_json::parse(schema_json);
        common_grammar_options options;
        options.strict = true; // a constraint that cannot be enforced is refused, never relaxed to "any string"
        const std::string grammar = json_schema_to_grammar(schema, options);
        if (out && out_size > grammar.size()) {
            std::copy(grammar.begin(), grammar.end(), out);
            out[grammar.size()] = '\0';
        }
        return (int32_t) grammar.size();
    } catch (const std::exception & e) {
        msg = e.what();
    }
    std::replace(msg.begin(), msg.end(), '\n', ' '); // the converter lists its errors a line each
    clover_set_err(err, err_size, "JSON schema: " + msg);
    return -1;
}

//
// a slot
//

int32_t clover_slot_generate(struct clover_slot * slot, const llama_token * prompt, int32_t n_prompt,
                             const struct clover_gen_params * params,
                             clover_tokens_cb on_tokens, clover_step_cb on_step, void * user_data,
                             struct clover_stats * stats) {
    if (!slot) {
        return -1;
    }
    clover_slot_guard guard(slot, true);
    slot->last_error.clear();
    clover_stats local_stats;
    if (!stats) {
        stats = &local_stats;
    }
    *stats = {};
    stats->n_prompt_tokens = n_prompt;
    const clover_gen_params defaults = clover_gen_default_params();
    if (!params) {
        params = &defaults;
    }
    stats->mode = params->mode;  // clover_dispatch names the mode it runs

    clover_run run;
    std::string err;
    if (!clover_run_init(slot, params, run, prompt, n_prompt, err)) {
        slot->last_error = err;  // nothing was touched
        return -1;
    }
    run.on_tokens = on_tokens;
    run.on_step   = on_step;
    run.user_data = user_data;
    run.stats     = stats;

    if (slot->rewound) {  // a cancelled generation left a truncated history that only reuse_prefix continues
        clover_slot_reset(slot);
    }
    if (!clover_prefill(slot, prompt, n_prompt, stats)) {
        return -1;
    }
    bool ok = false;
    try {
        ok = clover_dispatch(run);
    } catch (const std::exception & e) {
        // llama.cpp's grammar throws at a token past which it cannot go on (its stacks past their limit): the
        // call fails like any other, and the engine is reset, instead of the exception leaving the C API
        slot->last_error = std::string("generation failed: ") + e.what();
    }
    return clover_generate_end(slot, run, ok, stats);
}

void clover_slot_reset(struct clover_slot * slot) {
    if (!slot) {
        return;
    }
    clover_slot_guard guard(slot, false);
    llama_set_causal_attn(slot->ctx, true);
    if (slot->shared) {  // this slot's sequences only
        llama_memory_seq_rm(slot->mem, slot->seq_history, -1, -1);
        llama_memory_seq_rm(slot->mem, slot->seq_scratch, -1, -1);
    } else {
        llama_memory_clear(slot->mem, true);
    }
    slot->n_past      = 0;
    slot->has_pending = false;
    slot->pending     = 0;
    slot->history.clear();
    clover_cache_forget_all(slot);  // the checkpoints describe positions that are gone
}

int32_t clover_slot_n_past(const struct clover_slot * slot) {
    return slot ? slot->n_past : 0;
}

const char * clover_slot_last_error(const struct clover_slot * slot) {
    return slot ? slot->last_error.c_str() : "slot is NULL";
}

int32_t clover_slot_measure_costs(struct clover_slot * slot, struct clover_pass_costs * out) {
    if (!slot) {
        return -1;
    }
    if (!out) {
        slot->last_error = "out is NULL";
        return -1;
    }
    clover_slot_guard guard(slot, false);
    return clover_measure_costs(slot, *out) ? 0 : -1;
}

//
// deprecated names: one-line forwards (the clover_engine_* ones to slot 0)
//

int32_t clover_read_model_info(const char * path, struct clover_model_info * info, char * err, size_t err_size) {
    return clover_model_info_read(path, nullptr, info, err, err_size);
}

float clover_info_threshold(const struct clover_model_info * info, int32_t block_size) {
    return clover_model_info_threshold(info, block_size);
}

int32_t clover_generate(struct clover_engine * engine, const llama_token * prompt, int32_t n_prompt,
                        const struct clover_gen_params * params, clover_tokens_cb on_tokens, clover_step_cb on_step,
                        void * user_data, struct clover_stats * stats) {
    return clover_slot_generate(clover_engine_slot(engine, 0), prompt, n_prompt, params, on_tokens, on_step, user_data, stats);
}

void clover_engine_reset(struct clover_engine * engine) {
    clover_slot_reset(clover_engine_slot(engine, 0));
}

int32_t clover_engine_n_past(const struct clover_engine * engine) {
    return clover_slot_n_past(clover_first_slot(engine));
}

const char * clover_engine_last_error(const struct clover_engine * engine) {
    return engine ? clover_slot_last_error(clover_first_slot(engine)) : "engine is NULL";
}

void clover_engine_set_cache(struct clover_engine * engine, int64_t max_bytes, int32_t checkpoint_every) {
    clover_slot_set_cache(clover_engine_slot(engine, 0), max_bytes, checkpoint_every);
}

int32_t clover_engine_reuse_prefix(struct clover_engine * engine, const llama_token * prompt, int32_t n_prompt) {
    return clover_slot_reuse_prefix(clover_engine_slot(engine, 0), prompt, n_prompt);
}

void clover_engine_checkpoint_hint(struct clover_engine * engine, int32_t n_past) {
    clover_slot_checkpoint_hint(clover_engine_slot(engine, 0), n_past);
}

void clover_engine_cache_info(const struct clover_engine * engine, struct clover_cache_info * out) {
    clover_slot_cache_info(clover_first_slot(engine), out);
}

int32_t clover_engine_set_history(struct clover_engine * engine, const llama_token * tokens, int32_t n_tokens) {
    return clover_slot_set_history(clover_engine_slot(engine, 0), tokens, n_tokens);
}

}  // extern "C"
