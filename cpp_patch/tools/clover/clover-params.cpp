// A generate call's parameters, prefill and dispatch, and the load plan of an engine: everything the Clover engine
// resolves and checks before it decodes (or loads), so that a bad request or a plan that cannot work fails with one
// message naming it and touches nothing.

#include "clover-auto.h"
#include "clover-cache.h"
#include "clover-decode.h"
#include "clover-gen-params.h"
#include "clover-gguf.h"
#include "clover-llama.h"
#include "clover-log.h"
#include "clover-offload.h"
#include "clover-parallel.h"
#include "clover-params.h"
#include "clover-run.h"
#include "clover-sampling.h"
#include "clover-slot.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

//
// a generate call
//

// the block size and threshold a call uses (spec 4.3), or an error message
static bool clover_resolve_params(const clover_slot * slot, const clover_gen_params * params, int32_t & block_size,
                                  float & threshold, std::string & err) {
    if (params->mode < CLOVER_MODE_AR || params->mode > CLOVER_MODE_AUTO) {
        err = clover_format("unknown mode %d (0 = ar, 1 = diffusion, 2 = spec, 3 = auto)", params->mode);
        return false;
    }
    err = clover_gen_param_check(CLOVER_GEN_PARAM_BLOCK_SIZE, params->block_size);
    if (!err.empty()) {
        return false;
    }
    block_size = params->block_size > 0 ? params->block_size : slot->info.block_size;
    if (block_size > slot->max_block_size) {
        err = clover_format("block size %d exceeds this engine's max_block_size %d (set max_block_size when loading)",
                block_size, slot->max_block_size);
        return false;
    }
    threshold = params->threshold;
    err = clover_gen_param_check(CLOVER_GEN_PARAM_THRESHOLD, threshold);
    if (!err.empty()) {
        return false;
    }
    if (threshold < 0.0f) {
        threshold = llama_clover_threshold(slot->model, block_size);  // llama-server's default as well
        const int32_t * sizes = slot->info.calibrated_block_sizes;
        const bool calibrated = std::find(sizes, sizes + slot->info.n_calibrated, block_size) != sizes + slot->info.n_calibrated;
        if (!calibrated && params->mode != CLOVER_MODE_AR && params->mode != CLOVER_MODE_AUTO) {
            clover_log(GGML_LOG_LEVEL_WARN, "clover: block size %d is not among the calibrated sizes; using the default threshold %g\n",
                    block_size, (double) slot->info.threshold);
        }
    }
    return true;
}

// everything about a call's parameters that does not depend on the model, and the prompt's ids
static bool clover_check_params(const clover_slot * slot, const clover_gen_params * params, const llama_token * prompt,
                                int32_t n_prompt, std::string & err) {
    if (!prompt || n_prompt <= 0) {
        err = "the prompt is empty; at least one token is needed (the last one is the pending token)";
        return false;
    }
    for (int32_t i = 0; i < n_prompt; ++i) {
        if (prompt[i] < 0 || prompt[i] >= slot->n_vocab) {
            err = clover_format("prompt token %d at index %d is outside the vocabulary (%d)", prompt[i], i, slot->n_vocab);
            return false;
        }
    }
    // the table's ranges (clover-gen-params.h); these fields have no GGUF value
    const std::pair<clover_gen_param_id, double> ranged[] = {
        { CLOVER_GEN_PARAM_MAX_TOKENS,  (double) params->max_tokens },
        { CLOVER_GEN_PARAM_TEMPERATURE, (double) params->temperature },
        { CLOVER_GEN_PARAM_TOP_K,       (double) params->top_k },
        { CLOVER_GEN_PARAM_TOP_P,       (double) params->top_p },
        { CLOVER_GEN_PARAM_DRAFT_STEPS, (double) params->draft_steps },
    };
    for (const auto & it : ranged) {
        err = clover_gen_param_check(it.first, it.second);
        if (!err.empty()) {
            return false;
        }
    }
    if (params->draft_steps > 0 && params->temperature > 0.0f) {
        err = "draft_steps applies to greedy decoding only (temperature 0)";
    } else if (params->n_stop_ids > 0 && !params->stop_ids) {
        err = "stop_ids is NULL while n_stop_ids > 0";
    } else if (params->n_banned_ids > 0 && !params->banned_ids) {
        err = "banned_ids is NULL while n_banned_ids > 0";
    }
    return err.empty();
}

// what needs block passes (spec 5, "Files"): diffusion and spec need the block-diffusion tensors and a mask token
// (auto then drafts from n-grams only); the coreset top_p of the call's block passes
static bool clover_check_block_params(const clover_slot * slot, const clover_gen_params * params, float & coreset_top_p,
                                      std::string & err) {
    err = clover_gen_param_check(CLOVER_GEN_PARAM_CORESET_TOP_P, params->coreset_top_p);
    if (!err.empty()) {
        return false;
    }
    coreset_top_p = params->coreset_top_p > 0.0f ? params->coreset_top_p : slot->info.coreset_top_p;
    if ((params->mode == CLOVER_MODE_DIFFUSION || params->mode == CLOVER_MODE_SPEC) && !slot->can_block) {
        err = slot->block_unavailable;
        return false;
    }
    return true;
}

// the run a call describes: block size, threshold, coreset top_p, sampler and budget; false (nothing touched) with a
// message naming the bad parameter
bool clover_run_init(clover_slot * slot, const clover_gen_params * params, clover_run & run, const llama_token * prompt,
                     int32_t n_prompt, std::string & err) {
    float coreset_top_p = slot->info.coreset_top_p;
    if (!clover_resolve_params(slot, params, run.block_size, run.threshold, err) ||
        !clover_check_params(slot, params, prompt, n_prompt, err) ||
        !clover_check_block_params(slot, params, coreset_top_p, err) || !clover_init_sampler(slot, params, run.smp, err) ||
        !clover_init_dist(slot, params, run.dist, err) || !clover_init_chain(slot, params, run, err)) {
        return false;
    }
    slot->coreset_top_p = coreset_top_p;
    // on the history: every block pass of the call copies it to its window's scratch sequence, and a fused pass
    // reads it there (llama_clover_block_begin, LLAMA_CLOVER_PARAM_FUSED_WINDOW)
    llama_set_seq_param(slot->ctx, slot->seq_history, LLAMA_CLOVER_PARAM_CORESET_TOP_P, coreset_top_p);
    run.slot   = slot;
    run.params = params;
    run.budget = params->max_tokens;
    return true;
}

// prompt tokens for the next prefill pass: prefill_chunk while another slot is generating (its passes share the
// rounds between the chunks), else the whole batch
static int32_t clover_prefill_chunk(const clover_slot * slot) {
    const bool contended = slot->shared && slot->shared->n_generating > 1;
    return contended ? slot->prefill_chunk : slot->n_batch;
}

// causal pass over [old pending token, prompt[0 .. n-2]] in chunks (clover_prefill_chunk); prompt[n-1] becomes the
// pending token
bool clover_prefill(clover_slot * slot, const llama_token * prompt, int32_t n_prompt, clover_stats * stats) {
    std::vector<llama_token> pending;
    pending.reserve(n_prompt);
    if (slot->has_pending) {
        pending.push_back(slot->pending);
    }
    pending.insert(pending.end(), prompt, prompt + n_prompt - 1);
    if ((int64_t) slot->n_past + (int64_t) pending.size() + 1 > slot->n_ctx) {
        slot->last_error = clover_format("the prompt needs %lld positions, more than the context size %d",
                (long long) slot->n_past + (long long) pending.size() + 1, slot->n_ctx);
        return false;
    }
    const double t0 = clover_now_ms();
    for (size_t i = 0; i < pending.size();) {
        int32_t n = (int32_t) std::min<size_t>(clover_prefill_chunk(slot), pending.size() - i);
        // chunks end where a checkpoint is due (clover-cache.cpp)
        const int32_t due = clover_cache_next_due(slot);
        if (due > slot->n_past && due < slot->n_past + n) {
            n = due - slot->n_past;
        }
        slot->prefilling = true;
        const bool ok = clover_causal(slot, pending.data() + i, n, {}, "prefill");
        slot->prefilling = false;
        if (!ok) {
            slot->last_error += "; the engine was reset";
            clover_slot_reset(slot);
            return false;
        }
        i += n;
        if (slot->n_past == due) {
            clover_cache_save(slot);
        }
    }
    clover_cache_save(slot);  // where the answer starts
    stats->t_prefill_ms = clover_now_ms() - t0;
    slot->pending     = prompt[n_prompt - 1];
    slot->has_pending = true;
    return true;
}

bool clover_dispatch(clover_run & run) {
    // A constrained diffusion call runs as auto (docs/decoding.md, "Constrained decoding"): LowConfidence fills
    // targets out of order, where a grammar can only judge a token after the ones before it; auto's verification
    // keeps the output grammatical and equal to ar's.
    const bool constrained = run.params->grammar && run.params->grammar[0];
    const int32_t mode = run.params->mode == CLOVER_MODE_DIFFUSION && constrained ? CLOVER_MODE_AUTO : run.params->mode;
    run.stats->mode          = mode;
    run.stats->block_size    = run.block_size;
    run.stats->threshold     = run.threshold;
    run.stats->coreset_top_p = run.slot->coreset_top_p;
    if (run.budget == 0) {
        run.stats->stop_reason = CLOVER_STOP_LENGTH;
        return true;
    }
    switch (mode) {
        case CLOVER_MODE_AR:        return clover_run_ar(run);
        case CLOVER_MODE_DIFFUSION: return clover_run_diffusion(run);
        case CLOVER_MODE_SPEC:      return clover_run_spec(run);
        default:                    return clover_run_auto(run);
    }
}

//
// the load plan
//

static void clover_backend_init_once() {
    static std::once_flag flag;
    std::call_once(flag, [] { llama_backend_init(); });
}

bool clover_make_load_plan(const char * path, const clover_engine_params & params, clover_load_plan & plan,
                           std::string & err) {
    clover_model_info & info = plan.info;
    if (!clover_read_info(path, params.bd_path, info, err)) {
        return false;
    }
    if (params.n_ctx < 0 || params.n_batch < 0 || params.max_block_size < 0 || params.n_threads < 0 ||
        params.n_prefill_chunk < 0) {
        err = "engine params must not be negative";
        return false;
    }
    if (params.n_threads > GGML_MAX_N_THREADS) { // ggml's thread pool holds at most that many
        err = clover_format("n_threads %d must be at most %d (GGML_MAX_N_THREADS)", params.n_threads, GGML_MAX_N_THREADS);
        return false;
    }
    const int32_t n_parallel = params.n_parallel > 0 ? params.n_parallel : 1;  // 0 = one slot
    if (params.n_graph_cache > 64) {
        err = clover_format("n_graph_cache %d must be at most 64", params.n_graph_cache);
        return false;
    }
    if (n_parallel > 256) {
        err = clover_format("n_parallel %d must be in 1 .. 256", params.n_parallel);
        return false;
    }
    int32_t max_block = params.max_block_size;
    if (max_block == 0) {
        max_block = info.block_size;
        for (int32_t i = 0; i < info.n_calibrated; ++i) {
            max_block = std::max(max_block, info.calibrated_block_sizes[i]);
        }
    }
    if (max_block < 1 || max_block > 4096) {
        err = clover_format("max_block_size %d must be in 1 .. 4096", max_block);
        return false;
    }

    clover_backend_init_once();

    const int32_t n_layer = clover_gguf_n_layer(path, err);
    if (n_layer < 0 || !clover_offload_resolve(params, n_layer, plan.offload, err)) {
        return false;
    }
    plan.mparams = llama_model_default_params();
    plan.mparams.n_gpu_layers    = params.n_gpu_layers;
    plan.mparams.use_extra_bufts = params.use_extra_bufts;
    plan.offload.apply(plan.mparams);

    int32_t n_ctx = params.n_ctx;
    if (n_ctx == 0) {
        n_ctx = info.n_ctx_train > 0 ? std::min(info.n_ctx_train, 4096) : 4096;
    }
    // a non-causal window must fit one ubatch, and the hybrid memory's split keeps the trailing n_rs_seq + 1
    // tokens of a sequence in one ubatch, which needs n_ubatch > n_rs_seq + 1 = max_block
    const int32_t n_ubatch = std::max(max_block + 1, std::min(params.n_batch > 0 ? params.n_batch : 512, 512));
    const int32_t n_batch  = std::max(params.n_batch > 0 ? params.n_batch : 512, n_ubatch);

    llama_context_params & cparams = plan.cparams;
    cparams = llama_context_default_params();
    cparams.n_ctx      = std::max(n_ctx, n_batch);  // llama.cpp caps n_batch at n_ctx; the engine enforces n_ctx itself
    cparams.n_batch    = n_batch;
    cparams.n_ubatch   = n_ubatch;
    cparams.n_seq_max  = 2 * n_parallel;  // a history and a scratch sequence per slot (clover_new_slot)
    cparams.kv_unified = true;
    cparams.n_rs_seq   = max_block - 1;
    cparams.no_perf    = true;
    const int32_t n_threads = params.n_threads > 0 ? params.n_threads : clover_default_n_threads();
    cparams.n_threads       = n_threads;
    cparams.n_threads_batch = n_threads;

    if (n_ctx / n_parallel < 2) {
        err = clover_format("n_ctx %d leaves no room for %d slots (each slot gets n_ctx / n_parallel)", n_ctx, n_parallel);
        return false;
    }
    plan.bd_path    = params.bd_path ? params.bd_path : "";
    plan.max_block  = max_block;
    plan.n_ctx      = n_ctx / n_parallel;  // per slot, as llama-server divides -c among its -np slots
    plan.n_parallel = n_parallel;
    plan.n_graph_cache = params.n_graph_cache < 0 ? CLOVER_GRAPH_CACHE_DEFAULT : params.n_graph_cache;
    plan.n_batch   = n_batch;
    plan.prefill_chunk = params.n_prefill_chunk > 0 ? std::min(params.n_prefill_chunk, n_batch) : n_batch;
    return true;
}

// a plan that does not fit a GPU, or slots whose context does not fit host memory, is refused before loading,
// with the numbers, instead of failing in an allocation (or, on the host, being killed when the memory is touched)
static bool clover_check_plan_fits(const char * path, const clover_engine_params & params, const clover_load_plan & plan,
                                   std::string & msg) {
    const bool check_gpu  = params.n_gpu_layers != 0 && clover_n_gpu_devices() > 0;
    const bool check_host = plan.n_parallel > 1;
    if (params.fit_margin_mib < 0 || !(check_gpu || check_host)) {
        return true;
    }
    std::vector<clover_device_memory> devs;
    if (!clover_plan_memory(path, plan.mparams, plan.cparams, devs, msg)) {
        return false;
    }
    if (check_gpu) {
        std::vector<char> buf(4096);  // one line per device
        if (clover_check_fit(devs.data(), (int32_t) devs.size(), params.fit_margin_mib, buf.data(), buf.size()) != 0) {
            msg = buf.data();
            return false;
        }
    }
    return !check_host || clover_check_host_fit(devs, params.fit_margin_mib, plan.n_parallel, msg);
}

// the model and its context; each failure says why in msg, and what was made so far is freed
static bool clover_load_model(const char * path, const clover_load_plan & plan, clover_engine & engine, std::string & msg) {
    llama_model_ptr model(llama_model_load_from_file(path, plan.mparams));
    if (!model) {
        msg = clover_format("llama.cpp could not load '%s'", path);
        return false;
    }
    if (!plan.bd_path.empty()) {
        std::vector<char> buf(1024);
        if (!llama_clover_attach_block_diffusion(model.get(), plan.bd_path.c_str(), buf.data(), buf.size())) {
            msg = buf.data();
            return false;
        }
    }
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model.get()));
    if (plan.info.mask_token_id >= 0 && plan.info.mask_token_id >= n_vocab) {
        msg = clover_format("mask token id %d is outside the vocabulary (%d)", plan.info.mask_token_id, n_vocab);
        return false;
    }
    llama_context_ptr ctx(llama_init_from_model(model.get(), plan.cparams));
    if (!ctx) {
        msg = "llama.cpp could not create the context";
        return false;
    }
    if ((int32_t) llama_n_rs_seq(ctx.get()) < plan.max_block - 1) {
        msg = clover_format("the context has n_rs_seq = %u, rollback of B-1 = %d positions needs more",
                            llama_n_rs_seq(ctx.get()), plan.max_block - 1);
        return false;
    }
    // the decoding modes alternate pass shapes (block, verification, commit, ar step): keep their graphs
    llama_set_graph_cache_size(ctx.get(), plan.n_graph_cache);
    engine.model = std::move(model);
    engine.ctx   = std::move(ctx);
    return true;
}

// why block passes are unavailable on this model ("" when they are not)
static std::string clover_block_unavailable(const clover_model_info & info) {
    if (!info.has_block_diffusion) {
        return "clover: this GGUF has no block-diffusion tensors (a trunk-only file, e.g. from llama.cpp's "
               "converter); diffusion and spec need them: make a sidecar with clover-convert MODEL_DIR --bd-only NAME.bd.gguf and load it with --bd NAME.bd.gguf";
    }
    if (info.mask_token_id < 0) {
        return "clover: this GGUF has no mask token (no tokenizer.ggml.mask_token_id, and not exactly one "
               "control token named like 'mask'); diffusion and spec need one: set it with clover-convert --mask-token";
    }
    return "";
}

// the vocabulary's end-of-generation tokens
static std::vector<llama_token> clover_eog_ids(const llama_vocab * vocab) {
    std::vector<llama_token> out;
    for (llama_token t = 0; t < llama_vocab_n_tokens(vocab); ++t) {
        if (llama_vocab_is_eog(vocab, t)) {
            out.push_back(t);
        }
    }
    return out;
}

// slot i on the engine's model and context (sequences i and n_parallel + i), with the plan's sizes; nullptr when out of
// memory
static std::unique_ptr<clover_slot> clover_new_slot(clover_engine & engine, const clover_load_plan & plan,
                                                    const std::vector<llama_token> & eog_ids, int32_t i) {
    std::unique_ptr<clover_slot> slot(new (std::nothrow) clover_slot());
    if (!slot) {
        return nullptr;
    }
    llama_model * model = engine.model.get();
    slot->model            = model;
    slot->ctx              = engine.ctx.get();
    slot->vocab            = llama_model_get_vocab(model);
    slot->mem              = llama_get_memory(slot->ctx);
    slot->info             = plan.info;
    slot->info.n_vocab     = llama_vocab_n_tokens(slot->vocab);
    slot->info.n_ctx_train = llama_model_n_ctx_train(model);
    slot->info.has_block_diffusion = llama_clover_has_block_diffusion(model) ? 1 : 0;
    slot->coreset_top_p     = slot->info.coreset_top_p;
    slot->block_unavailable = clover_block_unavailable(slot->info);
    slot->can_block         = slot->block_unavailable.empty();
    slot->seq_history    = i;
    slot->seq_scratch    = plan.n_parallel + i;
    slot->drafter        = &engine.drafter;
    slot->n_ctx          = plan.n_ctx;
    slot->n_batch        = plan.n_batch;
    slot->prefill_chunk  = plan.prefill_chunk;
    slot->max_block_size = plan.max_block;
    slot->n_vocab        = slot->info.n_vocab;
    slot->eog_ids        = eog_ids;
    slot->batch_cap      = plan.n_batch;
    slot->batch          = llama_batch_init(plan.n_batch, 0, 1);
    if (!slot->batch.token) {
        return nullptr;
    }
    return slot;
}

std::unique_ptr<clover_engine> clover_engine_make(const char * path, const clover_engine_params & params,
                                                  clover_load_plan & plan, std::string & msg) {
    if (!clover_check_plan_fits(path, params, plan, msg)) {
        return nullptr;
    }
    std::unique_ptr<clover_engine> engine(new (std::nothrow) clover_engine());
    if (!engine) {
        msg = "out of memory";
        return nullptr;
    }
    if (!clover_load_model(path, plan, *engine, msg)) {
        return nullptr;
    }
    const std::vector<llama_token> eog_ids = clover_eog_ids(llama_model_get_vocab(engine->model.get()));
    for (int32_t i = 0; i < plan.n_parallel; ++i) {
        std::unique_ptr<clover_slot> slot = clover_new_slot(*engine, plan, eog_ids, i);
        if (!slot) {
            msg = "out of memory";
            return nullptr;
        }
        engine->slots.push_back(std::move(slot));
    }
    clover_drafter_init(engine->drafter, engine->ctx.get(), plan.n_parallel, engine->slots[0]->can_block);
    if (plan.n_parallel > 1) {
        clover_share_context(*engine, (int32_t) plan.cparams.n_ubatch);
    }
    return engine;
}
