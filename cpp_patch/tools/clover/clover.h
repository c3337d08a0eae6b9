// Clover decoding engine: ar, LowConfidence block diffusion and self-speculative decoding
// (shared/clover-spec.md section 4) on top of libllama. A plain C API, so Python binds it with ctypes.
//
// One engine (struct clover_engine) owns one model and one llama_context (kv_unified, n_rs_seq = max_block_size - 1)
// and n_parallel slots (struct clover_slot, default 1). Slot i owns sequence 2i (the committed history) and 2i + 1
// (the scratch sequence of its block passes). Successive clover_slot_generate calls on a slot continue its history
// (multi-turn chat) until clover_slot_reset. With n_parallel > 1, calls on different slots may run on different
// threads at once: their passes meet in rounds, and the causal passes of several slots, or their block windows of one
// width, run as one llama_decode (clover-parallel.cpp, docs/serve.md "Slots").
//
// Names are noun first: clover_engine_* take the engine, clover_slot_* a slot, clover_model_info_* the GGUF's
// settings. Functions that can fail return -1 (or NULL) and say why: in err (err_size bytes) where they take one,
// else in clover_slot_last_error.

#pragma once

#include "llama.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef CLOVER_SHARED
#    if defined(_WIN32) && !defined(__MINGW32__)
#        ifdef CLOVER_BUILD
#            define CLOVER_API __declspec(dllexport)
#        else
#            define CLOVER_API __declspec(dllimport)
#        endif
#    else
#        define CLOVER_API __attribute__ ((visibility ("default")))
#    endif
#else
#    define CLOVER_API
#endif

#ifdef __GNUC__
#    define CLOVER_DEPRECATED(func, hint) func __attribute__((deprecated(hint)))
#elif defined(_MSC_VER)
#    define CLOVER_DEPRECATED(func, hint) __declspec(deprecated(hint)) func
#else
#    define CLOVER_DEPRECATED(func, hint) func
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define CLOVER_MAX_CALIBRATED 16
#define CLOVER_HIST_SIZE      65   // histogram bins: index = value, the last bin holds everything larger

enum clover_mode {
    CLOVER_MODE_AR        = 0,
    CLOVER_MODE_DIFFUSION = 1,
    CLOVER_MODE_SPEC      = 2,
    CLOVER_MODE_AUTO      = 3,  // lossless: each round verifies the draft of llama.cpp's ngram-mod or draft-clover, or
                                // nothing (docs/decoding.md, "auto")
};

// How an auto round was drafted (clover_stats.auto_rounds).
enum clover_draft_kind {
    CLOVER_DRAFT_NONE  = 0,  // an ar step
    CLOVER_DRAFT_NGRAM = 1,  // llama.cpp's ngram-mod drafter (common/speculative)
    CLOVER_DRAFT_BLOCK = 2,  // llama.cpp's draft-clover drafter: argmax of one block pass (common/speculative)
    CLOVER_DRAFT_COUNT = 3,
};

// What a pass costs, in ms (clover_slot_measure_costs). Costs are given for runs of same-shape passes, plus what a
// pass whose graph is built pays on top. llama.cpp reuses the previous pass's graph when the shape is the same; with
// the graph cache (n_graph_cache > 0) it also reuses a kept one.
struct clover_pass_costs {
    float ar_ms;            // a 1-token causal step in a run of ar steps
    float causal_fixed_ms;  // a causal pass of w rows in a run of same-width passes: fixed + w * row
    float causal_row_ms;
    float rebuild_ms;       // added to a pass whose graph is built (without the graph cache: a change of shape)
    float block_fixed_ms;   // a block pass of w rows, right after a causal pass: fixed + w * row (its graph kept
                            // when the graph cache is on)
    float block_row_ms;
};

enum clover_stop_reason {
    CLOVER_STOP_NONE      = 0,
    CLOVER_STOP_LENGTH    = 1,  // max_tokens reached
    CLOVER_STOP_EOG       = 2,  // an end-of-generation token (not returned)
    CLOVER_STOP_CONTEXT   = 3,  // the context is full
    CLOVER_STOP_CANCELLED = 4,  // a callback returned false
};

// The clover GGUF settings, read as typed values from the file (spec v2 section 5; ARCH is the file's
// architecture: clover_moe, clover-moe or clovermoe). Every block-diffusion key is optional (llama.cpp's own
// converter writes none): an absent key gives spec 2.2's default.
struct clover_model_info {
    int32_t block_size;               // ARCH.block_size (default 32)
    float   threshold;                // ARCH.diffusion.threshold (default 0.95)
    int32_t mask_token_id;            // tokenizer.ggml.mask_token_id, else the one CONTROL / USER_DEFINED token whose
                                      // text contains "mask" (case-insensitive); -1 = none (block modes unavailable)
    int32_t conv_right_kernel;        // K_r = ssm.conv_kernel - 1 when the file has the block-diffusion tensors, else 0
    int32_t n_calibrated;
    int32_t calibrated_block_sizes[CLOVER_MAX_CALIBRATED];
    float   calibrated_thresholds [CLOVER_MAX_CALIBRATED];
    int32_t n_vocab;
    int32_t n_ctx_train;
    float   coreset_top_p;            // ARCH.diffusion.coreset_top_p (default 1: no coreset)
    int32_t history_rows;             // ARCH.diffusion.history_rows (default 32)
    int32_t has_block_diffusion;      // 1: the bd_* tensors are present; 0: a trunk-only file (ar and auto only)
    // the default penalties (spec 4): general.sampling.penalty_repeat (default 1: off),
    // general.sampling.penalty_present and general.sampling.penalty_freq (an older file's
    // ARCH.sampling.presence_penalty and ARCH.sampling.frequency_penalty; default 0)
    float   repeat_penalty;
    float   presence_penalty;
    float   frequency_penalty;
};

struct clover_engine_params {
    int32_t n_ctx;            // context size; 0 = min(n_ctx_train, 4096)
    int32_t n_batch;          // prefill chunk size (logical batch)
    int32_t max_block_size;   // largest B this engine accepts; 0 = max(block_size, calibrated sizes)
    int32_t n_threads;        // 0 = clover_default_n_threads()
    int32_t n_gpu_layers;     // offloaded layers (0 = CPU)
    bool    use_extra_bufts;  // CPU extra buffer types (AMX, repacked weights); false = llama.cpp's --no-repack

    // Where the weights go: llama.cpp's options, with its names, syntax and meanings (docs/native.md, "A 35B on
    // one 24 GB GPU"). An option that cannot be satisfied fails the load with a message naming it.
    const char * override_tensor;  // -ot: "<tensor name regex>=<buffer type>,..."; NULL or "" = none
    int32_t      n_cpu_moe;        // --n-cpu-moe: the experts (ffn_*_exps) of the first N layers stay in host memory
    bool         cpu_moe;          // --cpu-moe: the experts of every layer stay in host memory
    int32_t      split_mode;       // -sm: enum llama_split_mode NONE, LAYER or ROW; -1 = llama.cpp's default (LAYER)
    int32_t      main_gpu;         // -mg
    const char * tensor_split;     // -ts: "3,1": proportions per GPU (',' or '/'); NULL or "" = by free memory
    int32_t      fit_margin_mib;   // with layers on a GPU, refuse a load whose plan leaves less free on a device
                                   // (llama.cpp's --fit-target, default 1024); < 0 = no check
    int32_t      n_parallel;       // slots (llama-server's -np; 0 = 1); n_ctx is shared: each slot gets n_ctx / n_parallel
    const char * bd_path;          // a block-diffusion sidecar (NAME.bd.gguf, spec v2 section 5) for a trunk-only file;
                                   // NULL or "" = none. Refused unless its trunk fingerprint equals the file's.
    int32_t      n_prefill_chunk;  // with slots: prompt tokens per prefill pass while another slot generates (default
                                   // 128; 0 = n_batch; alone, a prompt is always prefilled in n_batch passes). The
                                   // other slots' passes share a chunk's round or run between chunks; a prefilling
                                   // slot gets at most 40% of the decode time while others wait, and the chunk bounds
                                   // their longest stall.
    int32_t      n_graph_cache;    // compute graphs kept besides the last one (llama_set_graph_cache_size): the block,
                                   // verification and commit passes then reuse theirs; -1 = CLOVER_GRAPH_CACHE_DEFAULT,
                                   // 0 = only the last one (llama.cpp's default). Each costs one compute buffer.
};

#define CLOVER_GRAPH_CACHE_DEFAULT 6

// One device's share of a load, from llama.cpp's no_alloc dry run (clover_engine_plan_memory), in bytes.
struct clover_device_memory {
    char    name[64];   // the ggml device name ("CUDA0"), or "Host" for host buffers (CPU weights, CPU context)
    bool    is_host;
    int64_t free;       // what ggml_backend_dev_memory reports (host: the system's)
    int64_t total;
    int64_t model;      // weights
    int64_t context;    // KV cache and recurrent state
    int64_t compute;    // compute buffers
};

// One emitted token's log P (spec 4's P, after bias, penalties and grammar) and the n_top most likely tokens with
// theirs, most likely first (ties to the lowest id). Return false to cancel.
typedef bool (*clover_logprobs_cb)(llama_token token, float logprob, const llama_token * top_ids,
                                   const float * top_logprobs, int32_t n_top, void * user_data);

struct clover_gen_params {
    int32_t             mode;          // enum clover_mode
    int32_t             block_size;    // 0 = ARCH.block_size
    float               threshold;     // < 0 = the calibrated threshold for block_size (spec 4.3)
    int32_t             draft_steps;   // spec mode: LowConfidence steps before the argmax draft (greedy only)
                                       // (auto mode: block_size bounds a block draft's length)
    float               temperature;   // 0 = greedy
    int32_t             top_k;         // 0 = off
    float               top_p;         // 1 = off
    uint32_t            seed;
    int32_t             max_tokens;
    const llama_token * stop_ids;      // end-of-generation tokens; NULL with n_stop_ids < 0 = the vocab's EOG set
    int32_t             n_stop_ids;
    const llama_token * banned_ids;    // never produced (the mask token is always banned)
    int32_t             n_banned_ids;
    float               coreset_top_p; // block passes' coreset top_p (spec 3.3) in (0, 1]; <= 0 = the GGUF's value

    // The distribution stage (spec 4, "Distributions and confidence"): after the logits come logit_bias, the
    // penalties, the grammar mask, then the banned ids and the mask token. All modes share it.
    const llama_token * bias_ids;          // logit_bias: bias_values[i] is added to the logit of bias_ids[i]
    const float       * bias_values;       // finite; -inf is allowed and bans the token
    int32_t             n_bias;
    float               repeat_penalty;    // > 0, 1 = off; NaN = the GGUF's (clover_model_info.repeat_penalty)
    float               presence_penalty;  // finite, 0 = off; NaN = the GGUF's
    float               frequency_penalty; // finite, 0 = off; NaN = the GGUF's
    const char        * grammar;           // GBNF (llama.cpp's grammars/README.md) the response must match; NULL or
                                           // "" = none. ar, auto and spec verify against it (lossless); diffusion
                                           // with a grammar runs as auto (docs/decoding.md, "Constrained decoding").
    const char        * grammar_root;      // its start symbol; NULL or "" = "root"
    const llama_token * grammar_after_ids; // the grammar applies from the token after the first of these the response
                                           // holds (thinking: "</think>"); n = 0: from the first token
    int32_t             n_grammar_after_ids;
    int32_t             n_logprobs;        // < 0: none; k >= 0: on_logprobs gets each emitted token's log P and the k
                                           // most likely tokens (diffusion: the confidence distribution it filled from)
    clover_logprobs_cb  on_logprobs;       // called with generate's user_data, before on_tokens delivers the tokens
    int32_t             spec_fused;        // spec mode: 1 = while every draft is accepted, a round's verification
                                           // and the next round's draft in one fused pass where the engine can (one
                                           // slot decoding, no draft_steps; docs/native.md, "The fused pass");
                                           // 0 (default) = a block pass and a verification per round. The tokens are
                                           // the same either way (lossless).
};

struct clover_stats {
    int32_t n_prompt_tokens;
    int32_t n_generated;
    int32_t n_block_passes;
    int32_t n_causal_passes;          // decode-time causal passes: ar steps, commits, verifications
    double  t_prefill_ms;
    double  t_block_ms;               // total time in block passes
    double  t_causal_ms;              // total time in decode-time causal passes
    int32_t steps_per_block[CLOVER_HIST_SIZE];   // histogram (diffusion)
    int32_t accepted_lengths[CLOVER_HIST_SIZE];  // histogram of m per round (spec)
    int32_t stop_reason;              // enum clover_stop_reason
    int32_t auto_rounds[CLOVER_DRAFT_COUNT];  // auto: rounds by enum clover_draft_kind
    int32_t auto_drafted;             // auto: draft tokens verified
    int32_t auto_accepted;            // auto: draft tokens accepted
    int32_t auto_accepted_block;      // auto: of those, the ones a block pass drafted
    int32_t n_graph_reuses;           // of the block and causal passes, those that reused a built graph (the last
                                      // one or a kept one, n_graph_cache); the others built theirs. With several
                                      // slots, a pass counts the reuses of the rounds it waited in.
    int32_t mode;                     // enum clover_mode the call ran in: the one asked for, except that a call in
                                      // CLOVER_MODE_DIFFUSION with a grammar runs as CLOVER_MODE_AUTO
    // the call's settings as resolved from clover_gen_params and the GGUF (a 0 / < 0 / <= 0 "the GGUF's value"
    // replaced by that value), so that no caller resolves them again
    int32_t block_size;               // B (clover_gen_params.block_size, else ARCH.block_size)
    float   threshold;                // the fill threshold (given, else the calibrated one for B, spec 4.3)
    float   coreset_top_p;            // the block passes' coreset top_p (given, else the GGUF's, spec 3.3)
    int32_t n_fused_passes;           // spec: of the causal passes, the fused ones (a verification with the next
                                      // round's block window in the same pass)
    int32_t n_replays;                // auto: of the causal passes, the replays: a verification that rejected more
                                      // positions than the recurrent state rolls back restored the state from
                                      // before it and decoded the kept tokens again (docs/decoding.md, "Bounds")
};

// Committed tokens, once per commit (a diffusion block, an accepted draft; ar: per token). Return false to cancel.
typedef bool (*clover_tokens_cb)(const llama_token * tokens, int32_t n_tokens, void * user_data);
// The canvas after each LowConfidence step: n_canvas targets, mask_token_id where still masked.
// Return false to cancel.
typedef bool (*clover_step_cb)(const llama_token * canvas, int32_t n_canvas, void * user_data);

struct clover_engine;  // a model, its context and its slots: clover_engine_load, clover_engine_free
struct clover_slot;    // one history on the engine's context: clover_engine_slot; owned by the engine
struct clover_chat_templates;  // a model's chat templates (common/chat): clover_chat_templates_init, _free

//
// the GGUF's settings, no engine needed
//

// Read the clover settings of a GGUF file, and of its block-diffusion sidecar when bd_path is not NULL or "" (the
// sidecar's keys override the file's; a sidecar of another trunk is refused, naming the fingerprint fields that
// differ). Returns 0, or -1 with a message in err (err may be NULL).
CLOVER_API int32_t clover_model_info_read(const char * path, const char * bd_path, struct clover_model_info * info,
                                          char * err, size_t err_size);

// The threshold a call with threshold < 0 uses (spec 4.3): the calibrated threshold for block_size, else the
// default (clover.diffusion.threshold). The one resolution of it: the engine, llama-clover and clover_cpp call this.
CLOVER_API float clover_model_info_threshold(const struct clover_model_info * info, int32_t block_size);

// The block-pass protocol (spec section 3; docs/native.md, "History protection"): on a context with
// n_seq_max >= 2 and a unified KV cache, copy the history (sequence 0) to the scratch sequence 1, decode batch
// (the window, on sequence 1, at the positions after the history) with causal attention off, then remove
// sequence 1 and turn causal attention back on. The history is never written. Returns llama_decode's code, -1
// for a NULL argument, or -3 (nothing done) when the model has no block-diffusion tensors (a trunk-only file).
// The coreset top_p is sequence 1's on the context (llama_set_seq_param with LLAMA_CLOVER_PARAM_CORESET_TOP_P,
// src/llama-clover.h), else the GGUF's value.
CLOVER_API int32_t clover_block_decode(struct llama_context * ctx, const struct llama_batch * batch);

// Physical cores this process may run on: its CPU affinity mask with SMT siblings counted once, capped by
// the cgroup CPU quota; at least 1. The engine's default for decode and batch threads alike.
CLOVER_API int32_t clover_default_n_threads(void);

CLOVER_API struct clover_engine_params clover_engine_default_params(void);
// mode CLOVER_MODE_AUTO, the GGUF's block size and calibrated threshold, greedy, 64 tokens, the vocab's EOG set
CLOVER_API struct clover_gen_params    clover_gen_default_params(void);

//
// the engine
//

// Load the model and create the context and its slots. Returns the engine, owned by the caller (free it with
// clover_engine_free), or NULL on failure (message in err).
CLOVER_API struct clover_engine * clover_engine_load(const char * path, struct clover_engine_params params,
                                                     char * err, size_t err_size);
// Frees the engine, its slots, its llama_context and its llama_model. NULL is allowed.
CLOVER_API void clover_engine_free(struct clover_engine * engine);

// The llama_model_params that clover_engine_load would use for these params, as "key=value" lines (n_gpu_layers,
// split_mode, main_gpu, tensor_split, one override=<regex>=<buffer type> per override, in llama.cpp's order).
// Returns 0, or -1 with the message clover_engine_load would give (err). Reads only the GGUF header.
CLOVER_API int32_t clover_engine_describe_offload(const char * path, struct clover_engine_params params,
                                                  char * out, size_t out_size, char * err, size_t err_size);
// What a load with these params would allocate on each device (llama.cpp's no_alloc dry run: no tensor data is
// read); the host entry is last. Returns the number of entries written (at most n_out), or -1 (err).
CLOVER_API int32_t clover_engine_plan_memory(const char * path, struct clover_engine_params params,
                                             struct clover_device_memory * out, int32_t n_out, char * err,
                                             size_t err_size);
// 0 when every non-host device keeps margin_mib free after its model + context + compute, else -1 and a message
// with the numbers ("needs X MiB on CUDA0 ..., Y GiB free"). clover_engine_load applies it with fit_margin_mib.
CLOVER_API int32_t clover_check_fit(const struct clover_device_memory * devs, int32_t n_devs, int32_t margin_mib,
                                    char * err, size_t err_size);
// llama.cpp's --rpc (common/arg.cpp add_rpc_devices): register a device for every "host:port" of the comma-separated
// list with the backend registry (ggml-rpc, an rpc-server at that address), so the next loads see them as GPU
// devices and offload -ngl layers to them (split by -ts, by default by free memory). Registration is for the
// process; an endpoint already added is skipped. Returns the number of devices added, or -1 with a message (a
// build without GGML_RPC, an empty entry, an unreachable server).
CLOVER_API int32_t clover_rpc_add_servers(const char * servers, char * err, size_t err_size);

// The model's clover settings as the engine resolved them. Borrowed: owned by the engine, valid until
// clover_engine_free. NULL for a NULL engine.
CLOVER_API const struct clover_model_info * clover_engine_info(const struct clover_engine * engine);

// Slot i of an engine loaded with n_parallel slots (slot 0 is the engine's first slot), or NULL when out of range.
// Borrowed: owned by the engine, freed by clover_engine_free and valid until then (the same pointer for every call
// with the same i). One thread at a time per slot; different slots may be driven from different threads.
CLOVER_API struct clover_slot * clover_engine_slot(struct clover_engine * engine, int32_t i);
CLOVER_API int32_t clover_engine_n_parallel(const struct clover_engine * engine);
// Passes run by the engine's slots, and the llama_decode rounds they ran in (n_passes > n_rounds: passes of
// several slots were batched together). Both 0 with a single slot.
CLOVER_API void    clover_engine_pass_stats(const struct clover_engine * engine, int64_t * n_passes, int64_t * n_rounds);
// The same for block passes only (diffusion and spec windows): n_passes > n_rounds when windows of several slots
// shared a block pass, each with its own coreset top_p. Both 0 with a single slot.
CLOVER_API void    clover_engine_block_pass_stats(const struct clover_engine * engine, int64_t * n_passes,
                                                  int64_t * n_rounds);
// The engine's llama_model and llama_context, for llama.cpp calls (tokenizer, state, sampling of your own).
// Borrowed: owned by the engine, freed by clover_engine_free and valid until then; never free them yourself.
CLOVER_API struct llama_model   * clover_engine_model  (struct clover_engine * engine);
CLOVER_API struct llama_context * clover_engine_context(struct clover_engine * engine);
// The context size of each slot: the positions a history may use (params.n_ctx / n_parallel resolved; llama.cpp's
// own context may be larger, as it is made at least n_batch).
CLOVER_API int32_t clover_engine_n_ctx(const struct clover_engine * engine);
// the largest block size this engine accepts (max_block_size as resolved at load)
CLOVER_API int32_t clover_engine_max_block_size(const struct clover_engine * engine);
// The threads the engine's context decodes with (the resolved n_threads).
CLOVER_API int32_t clover_engine_n_threads(const struct clover_engine * engine);

// Constrained decoding (clover_gen_params.grammar). Check a GBNF grammar against the engine's vocabulary: it parses
// (llama.cpp's parser: no undefined rule, no left recursion, the root symbol present; root NULL or "" = "root") and
// allows some token other than the mask token at its start. Returns 0, or -1 with a message in err.
CLOVER_API int32_t clover_engine_check_grammar(const struct clover_engine * engine, const char * grammar,
                                               const char * root, char * err, size_t err_size);
// A JSON schema (JSON text) as GBNF, converted as llama-server converts response_format and json_schema
// (common/json-schema-to-grammar). Returns the grammar's length and writes it, NUL-terminated, when out_size is
// larger (call with out_size 0 to size the buffer), or -1 with a one-line message in err: text that is not JSON, a
// schema the converter cannot express or enforce (it names the part: strict, so an unsupported `pattern` is an
// error, not "any string"), one that nests deeper than COMMON_JSON_SCHEMA_MAX_DEPTH (256), or one with an object of
// more than 1024 keys (common_json's objects find a key by a linear search).
CLOVER_API int32_t clover_json_schema_to_grammar(const char * schema_json, char * out, size_t out_size,
                                                 char * err, size_t err_size);

//
// chat: llama-server's chat templates (common/chat), for clients that render and parse as the server does
//

// A model's chat templates: the GGUF's (tokenizer.chat_template, and .tool_use when there is one), or
// template_override when it is non-empty (a built-in name such as "chatml", or a Jinja template's text, as
// llama-server's --chat-template). NULL with a message in err when the template does not parse.
CLOVER_API struct clover_chat_templates * clover_chat_templates_init(const struct llama_model * model,
                                                                     const char * template_override,
                                                                     char * err, size_t err_size);
CLOVER_API void clover_chat_templates_free(struct clover_chat_templates * tmpls);
// Render a chat request (JSON: "messages", "tools", "tool_choice" (a string), "parallel_tool_calls",
// "enable_thinking", "add_generation_prompt", "reasoning_format", "json_schema", "chat_template_kwargs", with
// llama-server's meanings) with common_chat_templates_apply. Returns JSON (free with clover_chat_string_free):
// "prompt", "format" (and "format_name"), "generation_prompt", "parser", "grammar", "grammar_lazy",
// "grammar_triggers", "preserved_tokens", "additional_stops", "supports_thinking", "thinking_start_tag",
// "thinking_end_tags"; or NULL with a message in err.
CLOVER_API char * clover_chat_templates_apply(const struct clover_chat_templates * tmpls, const char * request_json,
                                              char * err, size_t err_size);
// Parse generated text (the answer after the prompt) with common_chat_parse. params_json: an apply result (its
// "format", "generation_prompt" and "parser" are read), with "reasoning_format" and "parse_tool_calls" optional.
// is_partial: the text may stop mid-answer (streaming). Returns the message as llama-server's OpenAI JSON ("role",
// "content", "reasoning_content", "tool_calls"; free with clover_chat_string_free), or NULL with a message in err.
CLOVER_API char * clover_chat_parse(const char * params_json, const char * text, bool is_partial,
                                    char * err, size_t err_size);
CLOVER_API void clover_chat_string_free(char * s);

//
// a slot: one history on the engine's context
//

// Generate a continuation of the prompt on the slot's history. Returns the number of generated tokens
// (also written to stats), or -1 on error (clover_slot_last_error). After a cancellation the next generate starts
// fresh, unless clover_slot_reuse_prefix is called first: it can continue from the latest checkpoint.
CLOVER_API int32_t clover_slot_generate(struct clover_slot * slot, const llama_token * prompt, int32_t n_prompt,
                                        const struct clover_gen_params * params,
                                        clover_tokens_cb on_tokens, clover_step_cb on_step, void * user_data,
                                        struct clover_stats * stats);

// Forget the history: the next generate starts with a fresh prefill.
CLOVER_API void    clover_slot_reset(struct clover_slot * slot);
// Positions committed to the history so far (the pending token's position), or 0 after a reset.
CLOVER_API int32_t clover_slot_n_past(const struct clover_slot * slot);
// The message of the slot's last failure ("" when none). Owned by the slot: valid until the next call on the slot
// or clover_engine_free.
CLOVER_API const char * clover_slot_last_error(const struct clover_slot * slot);

// Prefix reuse (docs/serve.md, "Prefix reuse"). The slot keeps checkpoints of the history's recurrent state
// (llama_state_seq_get_data_ext with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) in host memory: at the end of every
// prefill (where the answer starts) and every checkpoint_every prefilled tokens. Attention KV entries can be
// cut at any position, the recurrent state only at a checkpoint.
struct clover_cache_info {
    int32_t n_checkpoints;     // checkpoints held now
    int64_t n_bytes;           // their host memory
    int64_t max_bytes;         // the budget (0 = no checkpoints)
    int64_t checkpoint_bytes;  // the size of one checkpoint of this model
    int64_t n_saved;           // checkpoints taken
    int64_t n_evicted;         // checkpoints dropped for the budget (least recently used first)
    int64_t n_restored;        // prompts that restored a checkpoint
    int64_t n_reused_tokens;   // prompt tokens not prefilled again, over all reuse_prefix calls
};

// Budget in bytes for the checkpoints (0 = none, the default) and the prefill interval between two of them
// (0 = only at the end of each prefill). Checkpoints over the new budget are evicted.
CLOVER_API void    clover_slot_set_cache(struct clover_slot * slot, int64_t max_bytes, int32_t checkpoint_every);
// Keep the longest prefix of the committed history that the prompt starts with and whose state can be restored
// (the whole history when the prompt extends it, else the nearest checkpoint at or before the divergence), and
// forget the rest. Returns n, the number of prompt tokens the history now holds (at most n_prompt - 1): the
// caller then generates with prompt + n, n_prompt - n. 0 means a fresh history (the slot was reset).
CLOVER_API int32_t clover_slot_reuse_prefix(struct clover_slot * slot, const llama_token * prompt, int32_t n_prompt);
// Also checkpoint when the next prefill reaches n_past: where the chat template's generation prompt starts, the
// last position the next turn's prompt shares with this one. Hints are cleared by clover_slot_reuse_prefix.
CLOVER_API void    clover_slot_checkpoint_hint(struct clover_slot * slot, int32_t n_past);
CLOVER_API void    clover_slot_cache_info(const struct clover_slot * slot, struct clover_cache_info * out);

// Sessions (clover-cpp chat's /save and /load): after the caller restored the history's sequence with
// llama_state_seq_set_data (the full state: KV entries and recurrent state), tell the slot which tokens it now
// holds. The sequence must hold exactly positions [0, n_tokens); the tokens must be in the vocabulary and leave
// room in the context. Checkpoints are dropped (they described the previous history); the next prompt that
// extends the tokens prefills only the rest (clover_slot_reuse_prefix). Returns 0, or -1 with last_error,
// and the slot reset (the restored sequence does not match the tokens).
CLOVER_API int32_t clover_slot_set_history(struct clover_slot * slot, const llama_token * tokens, int32_t n_tokens);

// What the slot's passes cost, measured now: about two dozen passes on the scratch sequence (the history is not
// touched). For benchmarks and capacity planning: no decoding rule reads it (auto mode times its own rounds).
// Returns 0, or -1 on error (last_error).
CLOVER_API int32_t clover_slot_measure_costs(struct clover_slot * slot, struct clover_pass_costs * out);

//
// deprecated names, kept for one release: the clover_engine_* forms act on slot 0
//

CLOVER_DEPRECATED(CLOVER_API int32_t clover_read_model_info(const char * path, struct clover_model_info * info,
                                                            char * err, size_t err_size),
                  "use clover_model_info_read(path, NULL, info, err, err_size)");
CLOVER_DEPRECATED(CLOVER_API float clover_info_threshold(const struct clover_model_info * info, int32_t block_size),
                  "use clover_model_info_threshold");
CLOVER_DEPRECATED(CLOVER_API int32_t clover_generate(struct clover_engine * engine, const llama_token * prompt,
                                                     int32_t n_prompt, const struct clover_gen_params * params,
                                                     clover_tokens_cb on_tokens, clover_step_cb on_step,
                                                     void * user_data, struct clover_stats * stats),
                  "use clover_slot_generate");
CLOVER_DEPRECATED(CLOVER_API void clover_engine_reset(struct clover_engine * engine), "use clover_slot_reset");
CLOVER_DEPRECATED(CLOVER_API int32_t clover_engine_n_past(const struct clover_engine * engine),
                  "use clover_slot_n_past");
CLOVER_DEPRECATED(CLOVER_API const char * clover_engine_last_error(const struct clover_engine * engine),
                  "use clover_slot_last_error");
CLOVER_DEPRECATED(CLOVER_API void clover_engine_set_cache(struct clover_engine * engine, int64_t max_bytes,
                                                          int32_t checkpoint_every),
                  "use clover_slot_set_cache");
CLOVER_DEPRECATED(CLOVER_API int32_t clover_engine_reuse_prefix(struct clover_engine * engine,
                                                                const llama_token * prompt, int32_t n_prompt),
                  "use clover_slot_reuse_prefix");
CLOVER_DEPRECATED(CLOVER_API void clover_engine_checkpoint_hint(struct clover_engine * engine, int32_t n_past),
                  "use clover_slot_checkpoint_hint");
CLOVER_DEPRECATED(CLOVER_API void clover_engine_cache_info(const struct clover_engine * engine,
                                                           struct clover_cache_info * out),
                  "use clover_slot_cache_info");
CLOVER_DEPRECATED(CLOVER_API int32_t clover_engine_set_history(struct clover_engine * engine,
                                                               const llama_token * tokens, int32_t n_tokens),
                  "use clover_slot_set_history");

#ifdef __cplusplus
}
#endif
