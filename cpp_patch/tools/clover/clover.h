// Clover decoding engine: ar, LowConfidence block diffusion and self-speculative decoding
// (shared/clover-spec.md section 4) on top of libllama. A plain C API, so Python binds it with ctypes.
//
// One engine owns one model and one llama_context (kv_unified, n_rs_seq = max_block_size - 1) with n_parallel
// slots (default 1). Slot i owns sequence 2i (the committed history) and 2i + 1 (the scratch sequence of its
// block passes). Successive clover_generate calls on a slot continue its history (multi-turn chat) until
// clover_engine_reset. With n_parallel > 1, calls on different slots may run on different threads at once: their
// passes meet in rounds, and same-kind, same-size passes of several slots run as one llama_decode
// (clover-parallel.cpp, docs/serve.md "Slots").

#pragma once

#include "llama.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CLOVER_MAX_CALIBRATED 16
#define CLOVER_HIST_SIZE      65   // histogram bins: index = value, the last bin holds everything larger

enum clover_mode {
    CLOVER_MODE_AR        = 0,
    CLOVER_MODE_DIFFUSION = 1,
    CLOVER_MODE_SPEC      = 2,
    CLOVER_MODE_AUTO      = 3,  // lossless: each round verifies an n-gram draft, a block draft or nothing (docs/decoding.md)
};

// How an auto round was drafted (clover_stats.auto_rounds).
enum clover_draft_kind {
    CLOVER_DRAFT_NONE  = 0,  // an ar step
    CLOVER_DRAFT_NGRAM = 1,  // tokens that followed the latest match of the last n-gram in the history
    CLOVER_DRAFT_BLOCK = 2,  // argmax of one block pass, cut at the best expected tokens per ms
    CLOVER_DRAFT_COUNT = 3,
};

// What a pass costs, in ms: auto mode's table. llama.cpp reuses a pass's graph when the previous pass had the
// same shape, so costs are given for runs of same-shape passes, plus what a pass whose shape changed pays on top.
struct clover_pass_costs {
    float ar_ms;            // a 1-token causal step in a run of ar steps
    float causal_fixed_ms;  // a causal pass of w rows in a run of same-width passes: fixed + w * row
    float causal_row_ms;
    float rebuild_ms;       // added to a pass whose graph is not reused (its shape differs from the previous one)
    float block_fixed_ms;   // a block pass of w rows, right after a causal pass: fixed + w * row
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
};

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

struct clover_gen_params {
    int32_t             mode;          // enum clover_mode
    int32_t             block_size;    // 0 = ARCH.block_size
    float               threshold;     // < 0 = the calibrated threshold for block_size (spec 4.3)
    int32_t             draft_steps;   // spec mode: LowConfidence steps before the argmax draft (greedy only)
                                       // (auto mode: block_size bounds the draft length)
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
    struct clover_pass_costs costs;   // auto: the cost table the decisions used (zeros otherwise)
};

// Committed tokens, once per committed block (ar: per token). Return false to cancel.
typedef bool (*clover_tokens_cb)(const llama_token * tokens, int32_t n_tokens, void * user_data);
// The canvas after each LowConfidence step: n_canvas targets, mask_token_id where still masked.
// Return false to cancel.
typedef bool (*clover_step_cb)(const llama_token * canvas, int32_t n_canvas, void * user_data);

struct clover_engine;

// The block-pass protocol (spec section 3; docs/native.md, "History protection"): on a context with
// n_seq_max >= 2 and a unified KV cache, copy the history (sequence 0) to the scratch sequence 1, decode batch
// (the window, on sequence 1, at the positions after the history) with causal attention off, then remove
// sequence 1 and turn causal attention back on. The history is never written. Returns llama_decode's code, or -3
// (nothing done) when the model has no block-diffusion tensors (a trunk-only file). The coreset top_p is the
// model's current setting (llama_clover_set_coreset_top_p in clover-llama.h; the GGUF's value by default).
int32_t clover_block_decode(struct llama_context * ctx, const struct llama_batch * batch);

// Physical cores this process may run on: its CPU affinity mask with SMT siblings counted once, capped by
// the cgroup CPU quota; at least 1. The engine's default for decode and batch threads alike.
int32_t clover_default_n_threads(void);

struct clover_engine_params clover_engine_default_params(void);
struct clover_gen_params    clover_gen_default_params(void);

// Read the clover settings of a GGUF file, and of its block-diffusion sidecar when bd_path is not NULL or "" (the
// sidecar's keys override the file's; a sidecar of another trunk is refused, naming the fingerprint fields that
// differ). Returns 0, or -1 with a message in err (err may be NULL).
int32_t clover_model_info_read(const char * path, const char * bd_path, struct clover_model_info * info, char * err,
                               size_t err_size);
// clover_model_info_read without a sidecar
int32_t clover_read_model_info(const char * path, struct clover_model_info * info, char * err, size_t err_size);

// The threshold a call with threshold < 0 uses (spec 4.3): the calibrated threshold for block_size, else the
// default (clover.diffusion.threshold). The one resolution of it: the engine, llama-clover and clover_cpp call this.
float clover_info_threshold(const struct clover_model_info * info, int32_t block_size);

// Load the model and create the context; NULL on failure (message in err).
struct clover_engine * clover_engine_load(const char * path, struct clover_engine_params params,
                                          char * err, size_t err_size);
void clover_engine_free(struct clover_engine * engine);

// The llama_model_params that clover_engine_load would use for these params, as "key=value" lines (n_gpu_layers,
// split_mode, main_gpu, tensor_split, one override=<regex>=<buffer type> per override, in llama.cpp's order).
// Returns 0, or -1 with the message clover_engine_load would give (err). Reads only the GGUF header.
int32_t clover_engine_describe_offload(const char * path, struct clover_engine_params params,
                                       char * out, size_t out_size, char * err, size_t err_size);
// What a load with these params would allocate on each device (llama.cpp's no_alloc dry run: no tensor data is
// read); the host entry is last. Returns the number of entries written (at most n_out), or -1 (err).
int32_t clover_engine_plan_memory(const char * path, struct clover_engine_params params,
                                  struct clover_device_memory * out, int32_t n_out, char * err, size_t err_size);
// 0 when every non-host device keeps margin_mib free after its model + context + compute, else -1 and a message
// with the numbers ("needs X MiB on CUDA0 ..., Y GiB free"). clover_engine_load applies it with fit_margin_mib.
int32_t clover_check_fit(const struct clover_device_memory * devs, int32_t n_devs, int32_t margin_mib,
                         char * err, size_t err_size);
// llama.cpp's --rpc (common/arg.cpp add_rpc_devices): register a device for every "host:port" of the comma-separated
// list with the backend registry (ggml-rpc, an rpc-server at that address), so the next loads see them as GPU
// devices and offload -ngl layers to them (split by -ts, by default by free memory). Registration is for the
// process; an endpoint already added is skipped. Returns the number of devices added, or -1 with a message (a
// build without GGML_RPC, an empty entry, an unreachable server).
int32_t clover_rpc_add_servers(const char * servers, char * err, size_t err_size);

const struct clover_model_info * clover_engine_info(const struct clover_engine * engine);

// Slot i of an engine loaded with n_parallel slots (slot 0 is the engine itself), or NULL when out of range. A slot
// takes every clover_engine_* and clover_generate call; it is owned (and freed) by the engine. One thread at a
// time per slot; different slots may be driven from different threads.
struct clover_engine * clover_engine_slot(struct clover_engine * engine, int32_t i);
int32_t clover_engine_n_parallel(const struct clover_engine * engine);
// Passes run by the engine's slots, and the llama_decode rounds they ran in (n_passes > n_rounds: passes of
// several slots were batched together). Both 0 with a single slot.
void    clover_engine_pass_stats(const struct clover_engine * engine, int64_t * n_passes, int64_t * n_rounds);
struct llama_model   * clover_engine_model  (struct clover_engine * engine);
struct llama_context * clover_engine_context(struct clover_engine * engine);

// Forget the history: the next generate starts with a fresh prefill.
void clover_engine_reset(struct clover_engine * engine);
// Positions committed to the history so far (the pending token's position), or 0 after a reset.
int32_t clover_engine_n_past(const struct clover_engine * engine);
// The engine's context size: the positions a history may use (params.n_ctx resolved; llama.cpp's own context may
// be larger, as it is made at least n_batch).
int32_t clover_engine_n_ctx(const struct clover_engine * engine);
// the largest block size this engine accepts (max_block_size as resolved at load)
int32_t clover_engine_max_block_size(const struct clover_engine * engine);
// The threads the engine's context decodes with (the resolved n_threads).
int32_t clover_engine_n_threads(const struct clover_engine * engine);

// Generate a continuation of the prompt on the engine's history. Returns the number of generated tokens
// (also written to stats), or -1 on error (clover_engine_last_error). After a cancellation the next generate starts
// fresh, unless clover_engine_reuse_prefix is called first: it can continue from the latest checkpoint.
int32_t clover_generate(struct clover_engine * engine, const llama_token * prompt, int32_t n_prompt,
                        const struct clover_gen_params * params,
                        clover_tokens_cb on_tokens, clover_step_cb on_step, void * user_data,
                        struct clover_stats * stats);

const char * clover_engine_last_error(const struct clover_engine * engine);

// Prefix reuse (docs/serve.md, "Prefix reuse"). The engine keeps checkpoints of the history's recurrent state
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
void    clover_engine_set_cache(struct clover_engine * engine, int64_t max_bytes, int32_t checkpoint_every);
// Keep the longest prefix of the committed history that the prompt starts with and whose state can be restored
// (the whole history when the prompt extends it, else the nearest checkpoint at or before the divergence), and
// forget the rest. Returns n, the number of prompt tokens the history now holds (at most n_prompt - 1): the
// caller then generates with prompt + n, n_prompt - n. 0 means a fresh history (the engine was reset).
int32_t clover_engine_reuse_prefix(struct clover_engine * engine, const llama_token * prompt, int32_t n_prompt);
// Also checkpoint when the next prefill reaches n_past: where the chat template's generation prompt starts, the
// last position the next turn's prompt shares with this one. Hints are cleared by clover_engine_reuse_prefix.
void    clover_engine_checkpoint_hint(struct clover_engine * engine, int32_t n_past);
void    clover_engine_cache_info(const struct clover_engine * engine, struct clover_cache_info * out);

// Sessions (clover-cpp chat's /save and /load): after the caller restored the history's sequence (0) with
// llama_state_seq_set_data (the full state: KV entries and recurrent state), tell the engine which tokens it now
// holds. The sequence must hold exactly positions [0, n_tokens); the tokens must be in the vocabulary and leave
// room in the context. Checkpoints are dropped (they described the previous history); the next prompt that
// extends the tokens prefills only the rest (clover_engine_reuse_prefix). Returns 0, or -1 with last_error,
// and the engine reset (the restored sequence does not match the tokens).
int32_t clover_engine_set_history(struct clover_engine * engine, const llama_token * tokens, int32_t n_tokens);

// Auto mode's cost table. The first auto generate measures it (about a dozen passes on the scratch sequence;
// the history is not touched) unless one was set; set_costs makes decisions reproducible (tests, a table
// measured once and saved). measure_costs measures now. Each returns 0, or -1 on error (last_error).
int32_t clover_engine_measure_costs(struct clover_engine * engine, struct clover_pass_costs * out);
int32_t clover_engine_set_costs    (struct clover_engine * engine, const struct clover_pass_costs * costs);
// 0 and the table, or -1 when none was measured or set yet.
int32_t clover_engine_get_costs    (const struct clover_engine * engine, struct clover_pass_costs * out);

#ifdef __cplusplus
}
#endif
