// Clover (spec v2): block-diffusion MoE on the Qwen3.5-MoE (qwen35moe) trunk; architectures clover_moe, clover-moe
// and clovermoe (one class; llama.cpp reads keys under each spelling's own name).
//
// Causal mode (cparams.causal_attn == true) is qwen35moe's graph, unchanged: this class derives from
// llama_model_qwen35moe and only overrides the GDN layer and the MoE FFN, which forward to qwen35moe in causal mode.
// A trunk-only file (no bd_* tensors, what llama.cpp's own converter writes) is exactly qwen35moe.
//
// Block mode (cparams.causal_attn == false; spec section 3) runs a window of W positions on top of the
// committed history. Attention layers are qwen35moe's, made non-causal by llama.cpp's mask. GDN layers (3.2):
//   u      = causal conv(history conv state ++ mixed) + right conv(mixed[1:] ++ zeros)   (before SiLU)
//   q^, k^ = l2norm(q), l2norm(k); key heads tiled to value heads (GGUF value-head order)
//   r_i    = S^T (q^_i * history_readout_scale)              (committed ssm state, read only)
//   l_ij   = bd_logit_scale_h * q^_i . k^_j,  l_iH = bd_history_bias_h + bd_history_c_h * ln(W / history_rows)
//   o_i    = softmax over {j, H}: sum_j w_ij v_j + w_iH r_i, then gated RMSNorm(z) and ssm_out.
// MoE layers (3.3): with coreset_top_p < 1 and W > 1, every row of a window picks its top-k inside the window's
// block coreset (build_coreset_bias); each window of a batched pass has its own sequence's top_p. Block mode reads the recurrent state (conv and ssm) and never writes it.

#include "models.h"
#include "llama-impl.h"
#include "llama-memory-recurrent.h"
#include "../clover-keys.h"
#include "../llama-clover.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

static std::string clover_key(llama_model_loader & ml, llm_kv kid) {
    return ml.llm_kv(kid);
}

// a bad hyperparameter from the file: a load error naming the key, never an abort later in a kernel
[[noreturn]] static void clover_bad_key(llama_model_loader & ml, llm_kv kid, const std::string & what) {
    throw std::runtime_error("clover: " + clover_key(ml, kid) + " " + what);
}

static bool clover_kernel_supported(uint32_t k) {
    // the right branch uses ggml_ssm_conv; the CUDA kernel exists only for these sizes
    return k == 3 || k == 4 || k == 5 || k == 9 || k == 15;
}

// Both layer kinds must be present, as upstream llama.cpp's clover_moe loader (b12060+) requires: Clover is a hybrid
// of Gated DeltaNet and full-attention layers (spec 1), and a file that only this tree loads would not interchange
// (spec 5). The kinds come from attention.recurrent_layers, else from full_attention_interval (qwen35moe's rule).
static void clover_check_layer_kinds(llama_model_loader & ml, const llama_hparams & hparams) {
    uint32_t n_recr = 0;
    for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
        n_recr += hparams.is_recr(il) ? 1 : 0;
    }
    if (n_recr > 0 && n_recr < hparams.n_layer()) {
        return;
    }
    uint32_t n_flags = 0;
    const bool from_array = ml.get_arr_n(LLM_KV_ATTENTION_RECURRENT_LAYERS, n_flags, false);
    const std::string key = clover_key(ml, from_array ? LLM_KV_ATTENTION_RECURRENT_LAYERS : LLM_KV_FULL_ATTENTION_INTERVAL);
    throw std::runtime_error("clover: " + key + " makes " + (n_recr == 0 ? "none" : "all") + " of the " +
            std::to_string(hparams.n_layer()) + " layers GDN (linear-attention) layers: a clover_moe model needs both "
            "GDN and full-attention layers");
}

void llama_model_clover::load_arch_hparams(llama_model_loader & ml) {
    // qwen35moe derives the layer kinds from full_attention_interval (a modulo) when the recurrent_layers array
    // is missing: a zero interval would divide by zero there
    uint32_t full_attn_interval = 4;
    if (ml.get_key(LLM_KV_FULL_ATTENTION_INTERVAL, full_attn_interval, false) && full_attn_interval == 0) {
        clover_bad_key(ml, LLM_KV_FULL_ATTENTION_INTERVAL, "= 0 must be > 0");
    }
    llama_model_qwen35moe::load_arch_hparams(ml);

    if (hparams.n_layer_nextn != 0) {
        throw std::runtime_error("clover: MTP/nextn layers are not supported (nextn_predict_layers must be 0)");
    }
    check_trunk_hparams(ml);
    clover_check_layer_kinds(ml, hparams);

    // llama.cpp's Clover converter writes expert_shared_count (num_shared_experts); only one shared expert has a
    // known layout
    uint32_t n_shared = 1;
    if (ml.get_key(LLM_KV_EXPERT_SHARED_COUNT, n_shared, false) && n_shared != 1) {
        clover_bad_key(ml, LLM_KV_EXPERT_SHARED_COUNT, "= " + std::to_string(n_shared) +
                " is not supported (only one shared expert)");
    }

    // the block-diffusion keys are optional (absent from llama.cpp's converter's files): spec 2.2's defaults
    hparams.clover_block_size            = 32;
    hparams.clover_threshold             = 0.95f;
    hparams.clover_coreset_top_p         = 1.0f;
    hparams.clover_history_rows          = 32;
    hparams.clover_history_readout_scale = 1.0f / sqrtf((float) hparams.ssm_d_state);
    hparams.clover_mask_token_id         = -1;
    load_bd_hparams(ml);
}

// llm_kv id of each block-diffusion key, in clover-keys.h's order
static llm_kv clover_bd_kv(clover_bd_key_id id) {
    static const llm_kv kvs[CLOVER_BD_KEY_COUNT] = {
#define CLOVER_BD_KEY_KV(ID, KV, SCOPE, SUFFIX, TYPE, DEF, LO, HI, LO_OPEN) KV,
        CLOVER_BD_KEYS(CLOVER_BD_KEY_KV)
#undef CLOVER_BD_KEY_KV
    };
    return kvs[id];
}

// a block-diffusion key (clover-keys.h) that is present, read as T and range-checked; an absent key keeps out
template <typename T>
static void clover_read_bd_key(llama_model_loader & ml, clover_bd_key_id id, T & out) {
    const std::string key = clover_bd_key_name(id, ml.get_arch_name());
    // the table and llama-arch's LLM_KV_NAMES must name the same key
    GGML_ASSERT(clover_key(ml, clover_bd_kv(id)) == key);
    T value = out;
    if (!ml.get_key(clover_bd_kv(id), value, false)) {
        return;
    }
    const std::string why = clover_bd_key_check(id, (double) value);
    if (!why.empty()) {
        throw std::runtime_error("clover: " + key + " = " + clover_bd_num_str((double) value) + " " + why);
    }
    out = value;
}

template <typename T>
static void clover_read_bd_array(llama_model_loader & ml, clover_bd_key_id id, std::vector<T> & out) {
    out.clear();
    ml.get_arr(clover_bd_kv(id), out, false);
    for (T v : out) {
        const std::string why = clover_bd_key_check(id, (double) v);
        if (!why.empty()) {
            throw std::runtime_error("clover: " + clover_bd_key_name(id, ml.get_arch_name()) + " holds " +
                    clover_bd_num_str((double) v) + "; each value " + why);
        }
    }
}

// The block-diffusion keys (spec v2 section 5, clover-keys.h), from the model file or from a sidecar
// (attach_block_diffusion). All are optional (llama.cpp's converter writes none): an absent key keeps spec 2.2's
// default.
void llama_model_clover::load_bd_hparams(llama_model_loader & ml) {
    // diffusion.shift_logits: only the shifted form (spec 3.4)
    bool shift_logits = true;
    if (ml.get_key(clover_bd_kv(CLOVER_BD_KEY_SHIFT_LOGITS), shift_logits, false) && !shift_logits) {
        throw std::runtime_error("clover: diffusion.shift_logits = false: unshifted block diffusion is not implemented");
    }

    clover_read_bd_key(ml, CLOVER_BD_KEY_BLOCK_SIZE,            hparams.clover_block_size);
    clover_read_bd_key(ml, CLOVER_BD_KEY_THRESHOLD,             hparams.clover_threshold);
    clover_read_bd_key(ml, CLOVER_BD_KEY_CORESET_TOP_P,         hparams.clover_coreset_top_p);
    clover_read_bd_key(ml, CLOVER_BD_KEY_HISTORY_ROWS,          hparams.clover_history_rows);
    clover_read_bd_key(ml, CLOVER_BD_KEY_HISTORY_READOUT_SCALE, hparams.clover_history_readout_scale);

    // the mask token: tokenizer.ggml.mask_token_id, else found by name in the vocabulary (the engine does that,
    // clover_model_info_read); -1 = none, and the block modes are unavailable. A sidecar without the key keeps the
    // trunk's.
    uint32_t mask_id = UINT32_MAX;
    clover_read_bd_key(ml, CLOVER_BD_KEY_MASK_TOKEN_ID, mask_id);
    if (mask_id != UINT32_MAX) {
        hparams.clover_mask_token_id = (int32_t) mask_id;
    }

    clover_read_bd_array(ml, CLOVER_BD_KEY_CALIBRATED_BLOCK_SIZES, clover_calibrated_block_sizes);
    clover_read_bd_array(ml, CLOVER_BD_KEY_CALIBRATED_THRESHOLDS,  clover_calibrated_thresholds);
    if (clover_calibrated_block_sizes.size() != clover_calibrated_thresholds.size()) {
        throw std::runtime_error("clover: " + clover_bd_key_name(CLOVER_BD_KEY_CALIBRATED_BLOCK_SIZES, ml.get_arch_name()) +
                " and " + clover_bd_key_name(CLOVER_BD_KEY_CALIBRATED_THRESHOLDS, ml.get_arch_name()) + " differ in length");
    }
}

// The qwen35moe trunk's hyperparameters, checked where a bad value would otherwise reach a GGML_ASSERT in a
// kernel (at the first decode) or a reshape: a malformed file is a load error that names the key.
void llama_model_clover::check_trunk_hparams(llama_model_loader & ml) const {
    const auto need = [&](bool ok, llm_kv kid, uint64_t value, const char * rule) {
        if (!ok) {
            clover_bad_key(ml, kid, "= " + std::to_string(value) + " " + rule);
        }
    };
    need(hparams.n_ctx_train > 0, LLM_KV_CONTEXT_LENGTH, hparams.n_ctx_train, "must be > 0");
    need(hparams.n_embd > 0, LLM_KV_EMBEDDING_LENGTH, hparams.n_embd, "must be > 0");
    need(hparams.n_head() > 0, LLM_KV_ATTENTION_HEAD_COUNT, hparams.n_head(), "must be > 0");
    need(hparams.n_head_kv() > 0 && hparams.n_head() % hparams.n_head_kv() == 0, LLM_KV_ATTENTION_HEAD_COUNT_KV,
            hparams.n_head_kv(), "must be > 0 and divide attention.head_count");
    need(hparams.n_expert > 0, LLM_KV_EXPERT_COUNT, hparams.n_expert, "must be > 0 (a mixture of experts)");
    need(hparams.n_ff_exp() > 0, LLM_KV_EXPERT_FEED_FORWARD_LENGTH, hparams.n_ff_exp(), "must be > 0");

    const uint32_t n_rot = hparams.n_rot_full;
    need(n_rot > 0 && n_rot % 2 == 0 && n_rot <= hparams.n_embd_head_k_full, LLM_KV_ROPE_DIMENSION_COUNT, n_rot,
            ("must be even and in 2 .. attention.key_length (" + std::to_string(hparams.n_embd_head_k_full) + ")").c_str());
    int64_t sections = 0;
    for (int i = 0; i < 4; ++i) {
        need(hparams.rope_sections[i] >= 0, LLM_KV_ROPE_DIMENSION_SECTIONS, (uint64_t) hparams.rope_sections[i],
                "must hold non-negative sections");
        sections += hparams.rope_sections[i];
    }
    need(2 * sections == n_rot, LLM_KV_ROPE_DIMENSION_SECTIONS, (uint64_t) sections,
            ("is the sum of the sections; it must be rope.dimension_count / 2 = " + std::to_string(n_rot / 2)).c_str());
    if (!(std::isfinite(hparams.rope_freq_base_train) && hparams.rope_freq_base_train > 0.0f)) {
        clover_bad_key(ml, LLM_KV_ROPE_FREQ_BASE, "= " + std::to_string(hparams.rope_freq_base_train) + " must be a positive number");
    }
    if (!(std::isfinite(hparams.f_norm_rms_eps) && hparams.f_norm_rms_eps > 0.0f && hparams.f_norm_rms_eps < 1.0f)) {
        clover_bad_key(ml, LLM_KV_ATTENTION_LAYERNORM_RMS_EPS, "= " + std::to_string(hparams.f_norm_rms_eps) +
                " must be a positive number below 1");
    }

    // upstream llama.cpp's clover_moe loader (b12060+) refuses different key and value head sizes: a file this tree
    // loads must load there too (spec 5: trunk files interchange)
    need(hparams.n_embd_head_v_full == hparams.n_embd_head_k_full, LLM_KV_ATTENTION_VALUE_LENGTH,
            hparams.n_embd_head_v_full,
            ("must equal attention.key_length (" + std::to_string(hparams.n_embd_head_k_full) + ")").c_str());

    need(hparams.ssm_d_conv > 0, LLM_KV_SSM_CONV_KERNEL, hparams.ssm_d_conv, "must be > 0");
    need(hparams.ssm_d_state > 0, LLM_KV_SSM_STATE_SIZE, hparams.ssm_d_state, "must be > 0");
    need(hparams.ssm_dt_rank > 0, LLM_KV_SSM_TIME_STEP_RANK, hparams.ssm_dt_rank, "must be > 0");
    need(hparams.ssm_n_group > 0 && hparams.ssm_dt_rank % hparams.ssm_n_group == 0, LLM_KV_SSM_GROUP_COUNT,
            hparams.ssm_n_group, "(key heads) must be > 0 and divide ssm.time_step_rank (value heads)");
    need(hparams.ssm_d_inner == hparams.ssm_d_state * hparams.ssm_dt_rank, LLM_KV_SSM_INNER_SIZE, hparams.ssm_d_inner,
            ("must be ssm.state_size * ssm.time_step_rank = " +
             std::to_string(hparams.ssm_d_state * hparams.ssm_dt_rank)).c_str());
}

// The types of the trunk's tensors that llama.cpp's loader does not check: these are F32 operands of binary ops,
// norms and ssm_conv, whose CPU kernels abort on anything else at the first decode. Matrix weights may be F32,
// F16, BF16 or quantized; an integer type would abort in the first mat-mul or get_rows.
static void clover_check_tensor_types(const llama_model_loader & ml) {
    static const char * const f32_suffixes[] = {
        "norm.weight", ".bias", "ssm_a", "ssm_conv1d.weight",
    };
    for (const auto & it : ml.weights_map) {
        const std::string & name = it.first;
        const ggml_tensor * t    = it.second.tensor;
        bool must_f32 = false;
        for (const char * suffix : f32_suffixes) {
            const size_t n = std::strlen(suffix);
            must_f32 |= name.size() >= n && name.compare(name.size() - n, n, suffix) == 0;
        }
        if (must_f32 && t->type != GGML_TYPE_F32) {
            throw std::runtime_error("clover: tensor '" + name + "' must be F32, got " + ggml_type_name(t->type));
        }
        const bool matrix_ok = t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_BF16 ||
                               ggml_is_quantized(t->type);
        if (!matrix_ok) {
            throw std::runtime_error("clover: tensor '" + name + "' has type " + ggml_type_name(t->type) +
                    "; weights must be F32, F16, BF16 or a quantized type");
        }
    }
}

void llama_model_clover::load_arch_tensors(llama_model_loader & ml) {
    clover_check_tensor_types(ml);

    llama_model_qwen35moe::load_arch_tensors(ml);

    LLAMA_LOAD_LOCALS;

    if (hparams.clover_mask_token_id >= 0 && (int64_t) hparams.clover_mask_token_id >= n_vocab) {
        throw std::runtime_error("clover: tokenizer.ggml.mask_token_id = " + std::to_string(hparams.clover_mask_token_id) +
                " is out of range (n_vocab = " + std::to_string(n_vocab) + ")");
    }

    clover_layers.assign(n_layer_all, clover_layer{});
    hparams.clover_has_block_diffusion = false;
    hparams.clover_conv_right_kernel   = 0;

    if (!check_bd_tensors(ml)) {
        LLAMA_LOG_INFO("%s: clover: no block-diffusion tensors (a trunk-only file): causal mode only\n", __func__);
        return;
    }
    const int64_t k_r = (int64_t) hparams.ssm_d_conv - 1;
    for (int il = 0; il < n_layer; ++il) {
        if (!hparams.is_recr(il)) {
            continue;
        }
        auto & cl = clover_layers[il];
        cl.bd_conv_right   = create_tensor(tn(LLM_TENSOR_CLOVER_BD_CONV_RIGHT,   "weight", il), { k_r, bd_conv_dim() }, 0);
        cl.bd_logit_scale  = create_tensor(tn(LLM_TENSOR_CLOVER_BD_LOGIT_SCALE,            il), { hparams.ssm_dt_rank }, 0);
        cl.bd_history_bias = create_tensor(tn(LLM_TENSOR_CLOVER_BD_HISTORY_BIAS,           il), { hparams.ssm_dt_rank }, 0);
        cl.bd_history_c    = create_tensor(tn(LLM_TENSOR_CLOVER_BD_HISTORY_C,              il), { hparams.ssm_dt_rank }, 0);
    }
    hparams.clover_has_block_diffusion = true;
    hparams.clover_conv_right_kernel   = (uint32_t) k_r;
}

int64_t llama_model_clover::bd_conv_dim() const {
    const int64_t key_dim   = (int64_t) hparams.ssm_d_state * hparams.ssm_n_group;
    const int64_t value_dim = (int64_t) hparams.ssm_d_state * hparams.ssm_dt_rank;
    return 2 * key_dim + value_dim;
}

std::string llama_model_clover::bd_tensor_name(int kind, int il) const {
    static const llm_tensor kinds[4] = {
        LLM_TENSOR_CLOVER_BD_CONV_RIGHT, LLM_TENSOR_CLOVER_BD_LOGIT_SCALE,
        LLM_TENSOR_CLOVER_BD_HISTORY_BIAS, LLM_TENSOR_CLOVER_BD_HISTORY_C,
    };
    return kind == 0 ? tn(kinds[kind], "weight", il).str() : tn(kinds[kind], il).str();
}

// The four block-diffusion tensors of each GDN layer, as a group: false when the file has none of them in any layer
// (a trunk-only file: llama.cpp's converter writes those), true when every GDN layer has all four with the right
// type and K_r; anything in between is an error that names the first tensor missing or wrong. The shapes are
// checked where the tensors are created.
bool llama_model_clover::check_bd_tensors(const llama_model_loader & ml) const {
    bool any = false;
    for (uint32_t il = 0; il < hparams.n_layer() && !any; ++il) {
        for (int k = 0; k < 4 && !any; ++k) {
            any = hparams.is_recr(il) && ml.get_tensor_meta(bd_tensor_name(k, il).c_str()) != nullptr;
        }
    }
    if (!any) {
        return false;
    }
    const int64_t k_r_expected = (int64_t) hparams.ssm_d_conv - 1;
    for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
        if (!hparams.is_recr(il)) {
            continue;
        }
        for (int k = 0; k < 4; ++k) {
            const std::string name = bd_tensor_name(k, il);
            const ggml_tensor * meta = ml.get_tensor_meta(name.c_str());
            if (meta == nullptr) {
                throw std::runtime_error("clover: tensor '" + name + "' is missing: the block-diffusion tensors "
                        "(bd_conv_right, bd_logit_scale, bd_history_bias, bd_history_c) must be in every GDN layer or in none");
            }
            if (meta->type != GGML_TYPE_F32) {
                throw std::runtime_error("clover: tensor '" + name + "' must be F32, got " + ggml_type_name(meta->type));
            }
            if (k == 0 && meta->ne[0] != k_r_expected) {
                throw std::runtime_error("clover: tensor '" + name + "' has K_r = " + std::to_string(meta->ne[0]) +
                        " right-context taps, but ssm.conv_kernel - 1 = " + std::to_string(k_r_expected));
            }
        }
    }
    if (!clover_kernel_supported((uint32_t) k_r_expected)) {
        throw std::runtime_error("clover: K_r = " + std::to_string(k_r_expected) +
                " right-context taps are not supported (supported: 3, 4, 5, 9, 15)");
    }
    return true;
}

// A sidecar (spec v2 section 5, "Files"): the block-diffusion keys and tensors of a trunk-only model in a GGUF of
// their own, attached after the trunk is loaded, as llama.cpp attaches a LoRA adapter (llama-adapter.cpp): each
// tensor goes to the buffer type of its layer's ssm_conv1d, so it lives on the device that runs the layer. The
// trunk's fingerprint is checked by the caller (libclover) before the trunk is loaded.
void llama_model_clover::attach_block_diffusion(const std::string & path) {
    if (hparams.clover_has_block_diffusion) {
        throw std::runtime_error("the model already has block-diffusion tensors: a sidecar goes with a trunk-only file");
    }
    std::vector<std::string> splits;
    llama_model_loader ml(nullptr, nullptr, nullptr, path, splits, nullptr, LLAMA_LOAD_MODE_NONE,
                          /*check_tensors =*/ true, /*no_alloc =*/ false, /*load_mtp =*/ false, nullptr, nullptr);
    if (!llm_arch_is_clover(ml.get_arch())) {
        throw std::runtime_error("general.architecture is '" + ml.get_arch_name() + "', not a clover_moe sidecar");
    }
    if (!check_bd_tensors(ml)) {
        throw std::runtime_error("it holds no block-diffusion tensors (blk.N.bd_conv_right.weight, ...) for this model's "
                                 "GDN layers");
    }
    const int64_t k_r = (int64_t) hparams.ssm_d_conv - 1;
    const int64_t n_v = hparams.ssm_dt_rank;
    size_t n_expected = 0;
    std::map<ggml_backend_buffer_type_t, ggml_context_ptr> ctx_of;
    std::vector<clover_layer> attached(hparams.n_layer_all);
    for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
        if (!hparams.is_recr(il)) {
            continue;
        }
        if (layers[il].ssm_conv1d == nullptr || layers[il].ssm_conv1d->buffer == nullptr) {
            throw std::runtime_error("the model's weights are not allocated (a no_alloc load)");
        }
        ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(layers[il].ssm_conv1d->buffer);
        auto & ctx = ctx_of[buft];
        if (!ctx) {
            ggml_init_params params = { 4 * hparams.n_layer() * ggml_tensor_overhead(), nullptr, /*no_alloc =*/ true };
            ctx.reset(ggml_init(params));
        }
        ggml_tensor ** dst[4] = { &attached[il].bd_conv_right, &attached[il].bd_logit_scale,
                                  &attached[il].bd_history_bias, &attached[il].bd_history_c };
        for (int k = 0; k < 4; ++k) {
            const std::string name = bd_tensor_name(k, il);
            const ggml_tensor * meta = ml.get_tensor_meta(name.c_str());
            const int64_t want0 = k == 0 ? k_r : n_v;
            const int64_t want1 = k == 0 ? bd_conv_dim() : 1;
            if (meta->ne[0] != want0 || meta->ne[1] != want1 || meta->ne[2] != 1 || meta->ne[3] != 1) {
                throw std::runtime_error(format("tensor '%s' has shape %s, but this model needs {%lld, %lld}", name.c_str(),
                        llama_format_tensor_shape(meta).c_str(), (long long) want0, (long long) want1));
            }
            *dst[k] = ggml_dup_tensor(ctx.get(), meta);
            ggml_set_name(*dst[k], name.c_str());
            n_expected++;
        }
    }
    if (ml.weights_map.size() != n_expected) {
        for (const auto & it : ml.weights_map) {
            if (std::none_of(attached.begin(), attached.end(), [&](const clover_layer & cl) {
                    return cl.bd_conv_right && (it.first == ggml_get_name(cl.bd_conv_right) ||
                            it.first == ggml_get_name(cl.bd_logit_scale) || it.first == ggml_get_name(cl.bd_history_bias) ||
                            it.first == ggml_get_name(cl.bd_history_c)); })) {
                throw std::runtime_error("tensor '" + it.first + "' is not a block-diffusion tensor of this model");
            }
        }
    }

    std::vector<ggml_backend_buffer_ptr> bufs;
    std::vector<uint8_t> data;
    for (auto & it : ctx_of) {
        ggml_backend_buffer_ptr buf(ggml_backend_alloc_ctx_tensors_from_buft(it.second.get(), it.first));
        if (!buf) {
            throw std::runtime_error(format("cannot allocate the block-diffusion tensors in %s", ggml_backend_buft_name(it.first)));
        }
        ggml_backend_buffer_set_usage(buf.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        for (ggml_tensor * t = ggml_get_first_tensor(it.second.get()); t; t = ggml_get_next_tensor(it.second.get(), t)) {
            const auto & w = ml.require_weight(ggml_get_name(t));
            data.resize(ggml_nbytes(t));
            ml.load_data_range(w, 0, data.size(), data.data());  // checks the values (check_tensors)
            ggml_backend_tensor_set(t, data.data(), 0, data.size());
        }
        bufs.push_back(std::move(buf));
    }

    // the keys last: a failure above leaves the model as it was
    llama_hparams saved = hparams;
    try {
        load_bd_hparams(ml);
        if (hparams.clover_mask_token_id >= (int32_t) vocab.n_tokens()) {
            throw std::runtime_error(format("tokenizer.ggml.mask_token_id = %d is out of range (n_vocab = %u)",
                    hparams.clover_mask_token_id, vocab.n_tokens()));
        }
    } catch (...) {
        hparams = saved;
        throw;
    }
    for (auto & it : ctx_of) {
        clover_sidecar_ctxs.push_back(std::move(it.second));
    }
    for (auto & buf : bufs) {
        clover_sidecar_bufs.push_back(std::move(buf));
    }
    clover_layers = attached;
    hparams.clover_has_block_diffusion = true;
    hparams.clover_conv_right_kernel   = (uint32_t) k_r;
    LLAMA_LOG_INFO("%s: clover: block-diffusion tensors and keys attached from %s\n", __func__, path.c_str());
}

std::unique_ptr<llm_graph_context> llama_model_clover::build_arch_graph(const llm_graph_params & params) const {
    if (params.gtype == LLM_GRAPH_TYPE_DECODER_MTP) {
        throw std::runtime_error("clover: no MTP graph");
    }
    return std::make_unique<graph>(*this, params);
}

float llama_model_clover::coreset_top_p_of(const llama_seq_params * sp, llama_seq_id seq) const {
    const float own = sp ? sp->get(seq, LLAMA_CLOVER_PARAM_CORESET_TOP_P) : NAN;
    return own > 0.0f && own <= 1.0f ? own : hparams.clover_coreset_top_p;  // NaN (unset) fails the test
}

// the sequence of window s of a block ubatch: split_equal lays the windows out one after the other, W rows each
static llama_seq_id clover_window_seq(const llama_ubatch & ubatch, uint32_t s) {
    return ubatch.seq_id[s * ubatch.n_seq_tokens][0];
}

// whether any window of the ubatch routes inside a coreset (its sequence's top_p is below 1)
static bool clover_coreset_active(const llama_model_clover & model, const llama_seq_params * sp,
                                  const llama_ubatch & ubatch) {
    for (uint32_t s = 0; s < ubatch.n_seqs; ++s) {
        if (model.coreset_top_p_of(sp, clover_window_seq(ubatch, s)) < 1.0f) {
            return true;
        }
    }
    return false;
}

// The block coreset's top_p as a graph input (spec 3.3), one value per window: a reused block graph reads each
// sequence's current setting (coreset_top_p_of) at every pass. A graph is built with the coreset ops when some
// window's top_p is below 1 and without them when none is (every expert: no cut is computed), so a change across
// 1 rebuilds the graph. In a graph with the coreset ops, a window at top_p 1 gets 2: excl[e] <= 1 < 2 keeps every
// expert, its bias is 0 and its rows route exactly per row.
class llm_graph_input_clover_coreset : public llm_graph_input_i {
public:
    llm_graph_input_clover_coreset(const llama_model_clover & model, const llama_seq_params * sp, bool active) :
        model(model), sp(sp), active(active) {}

    void set_input(const llama_ubatch * ubatch) override {
        if (top_p == nullptr) {
            return;
        }
        GGML_ASSERT(top_p->ne[2] == (int64_t) ubatch->n_seqs);
        std::vector<float> v(ubatch->n_seqs);
        for (uint32_t s = 0; s < ubatch->n_seqs; ++s) {
            const float p = model.coreset_top_p_of(sp, clover_window_seq(*ubatch, s));
            v[s] = p < 1.0f ? p : 2.0f;
        }
        ggml_backend_tensor_set(top_p, v.data(), 0, v.size() * sizeof(float));
    }

    bool can_reuse(const llm_graph_params & params) override {
        const bool shape_ok = top_p == nullptr || top_p->ne[2] == (int64_t) params.ubatch.n_seqs;
        return shape_ok && clover_coreset_active(model, params.seq_params, params.ubatch) == active;
    }

    ggml_tensor * top_p = nullptr;  // F32 {1, 1, n_seqs}; nullptr when inactive

private:
    const llama_model_clover & model;
    const llama_seq_params * sp;  // the context's
    const bool active;
};

int32_t llama_model_clover::fused_window_of(const llama_seq_params * sp, llama_seq_id seq) const {
    const float w = sp ? sp->get(seq, LLAMA_CLOVER_PARAM_FUSED_WINDOW) : NAN;
    return w >= 1.0f && w < 1048576.0f ? (int32_t) w : 0;  // NaN (unset) fails the test
}

// the fused window of a causal ubatch: its sequence's setting when the ubatch is that one sequence and holds causal
// rows before the window, else 0 (an ordinary causal pass)
static int64_t clover_fused_window(const llama_model_clover & model, const llama_seq_params * sp,
                                   const llama_cparams & cparams, const llama_ubatch & ubatch) {
    if (!cparams.causal_attn || ubatch.n_seqs != 1 || !model.hparams.clover_has_block_diffusion) {
        return 0;
    }
    const int64_t w = model.fused_window_of(sp, ubatch.seq_id[0][0]);
    return w > 0 && w < (int64_t) ubatch.n_seq_tokens ? w : 0;
}

// Every causal graph carries this input: a fused pass (a block window in the last rows) is built apart from an
// ordinary causal pass of the same shape, so neither reuses the other's graph. In a fused graph it makes the
// window's rows of the attention mask non-causal after llama.cpp has set the causal mask (inputs are set in the
// order they were added, and this one comes after the memory's): the window's last row has the sequence's largest
// position, so its causal row sees every cell of the sequence, which is what each window row sees in block mode;
// the causal rows keep theirs (the window's cells lie after them).
class llm_graph_input_clover_fused : public llm_graph_input_i {
public:
    llm_graph_input_clover_fused(const llama_model_clover & model, int64_t fused_w, ggml_tensor * kq_mask) :
        model(model), fused_w(fused_w), kq_mask(kq_mask) {}

    void set_input(const llama_ubatch * ubatch) override {
        if (fused_w == 0 || kq_mask == nullptr) {
            return;
        }
        GGML_ASSERT(ggml_backend_buffer_is_host(kq_mask->buffer));
        GGML_ASSERT(kq_mask->ne[1] == (int64_t) ubatch->n_tokens && kq_mask->ne[3] == 1);
        auto * data = (uint8_t *) kq_mask->data;
        const int64_t last = ubatch->n_tokens - 1;
        for (int64_t i = ubatch->n_tokens - fused_w; i < last; ++i) {
            memcpy(data + i * kq_mask->nb[1], data + last * kq_mask->nb[1], kq_mask->nb[1]);
        }
    }

    bool can_reuse(const llm_graph_params & params) override {
        return clover_fused_window(model, params.seq_params, params.cparams, params.ubatch) == fused_w;
    }

private:
    const llama_model_clover & model;
    const int64_t fused_w;
    ggml_tensor * kq_mask;  // the hybrid memory input's attention mask (host)
};

llama_model_clover::graph::graph(const llama_model & model, const llm_graph_params & params) :
    llama_model_qwen35moe::graph(model, params, defer_build{}) {
    const auto & cmodel = static_cast<const llama_model_clover &>(model);
    fused_w = clover_fused_window(cmodel, params.seq_params, cparams, ubatch);
    // block windows of more than one row may route inside a coreset (a one-row window is per-row routing)
    const int64_t window_rows = fused_w > 0 ? fused_w : cparams.causal_attn ? 0 : (int64_t) ubatch.n_seq_tokens;
    if (window_rows > 1 && n_expert_used < n_expert && n_expert > 0) {
        const bool active = clover_coreset_active(cmodel, params.seq_params, ubatch);
        auto inp = std::make_unique<llm_graph_input_clover_coreset>(cmodel, params.seq_params, active);
        if (active) {
            inp->top_p = ggml_new_tensor_3d(ctx0, GGML_TYPE_F32, 1, 1, ubatch.n_seqs);
            ggml_set_input(inp->top_p);
            ggml_set_name(inp->top_p, "clover_coreset_top_p");
            coreset_top_p = inp->top_p;
        }
        res->add_input(std::move(inp));
    }
    build();
    if (cparams.causal_attn) {
        ggml_tensor * kq_mask = nullptr;
        for (const auto & input : res->inputs) {
            if (const auto * hybrid = dynamic_cast<const llm_graph_input_mem_hybrid *>(input.get())) {
                kq_mask = hybrid->get_attn()->self_kq_mask;
            }
        }
        GGML_ASSERT(fused_w == 0 || kq_mask != nullptr);
        res->add_input(std::make_unique<llm_graph_input_clover_fused>(cmodel, fused_w, kq_mask));
    }
}

// Spec 3.3 without sort or cumsum (every op here exists on CPU, CUDA and Metal): per window s, with m[e] the mean
// over its rows of the router probabilities, G[e', e] = step(m[e'] - m[e]) (1 where e' ranks strictly before e),
// excl[e] = sum_e' G[e', e] m[e'] (the mass ranked before e) and rank[e] = sum_e' G[e', e]. Expert e is in the
// coreset when excl[e] < top_p (the shortest prefix reaching top_p) or rank[e] < k (the extension to k experts).
// The bias is 0 for the coreset and -1e30 (finite: no 0 * inf, no NaN) for the rest.
ggml_tensor * llama_model_clover::graph::build_coreset_bias(ggml_tensor * probs, int64_t n_w, int64_t n_s, int il) {
    const int64_t n_e = n_expert;

    ggml_tensor * p = ggml_reshape_3d(ctx0, probs, n_e, n_w, n_s);                   // {E, W, S}
    p = ggml_cont(ctx0, ggml_permute(ctx0, p, 1, 0, 2, 3));                          // {W, E, S}
    ggml_tensor * m = ggml_mean(ctx0, p);                                            // {1, E, S}: m[e]
    cb(m, "clover_coreset_mass", il);

    ggml_tensor * m_before = ggml_repeat_4d(ctx0, ggml_reshape_3d(ctx0, m, n_e, 1, n_s), n_e, n_e, n_s, 1); // [e', e] = m[e']
    ggml_tensor * g    = ggml_step(ctx0, ggml_sub(ctx0, m_before, m));              // {E, E, S}
    ggml_tensor * excl = ggml_sum_rows(ctx0, ggml_mul(ctx0, g, m_before));          // {1, E, S}
    ggml_tensor * rank = ggml_sum_rows(ctx0, g);                                     // {1, E, S}

    // excl < top_p, top_p {1, 1, S}: each window's own
    ggml_tensor * in_p = ggml_step(ctx0, ggml_scale(ctx0, ggml_sub(ctx0, excl, coreset_top_p), -1.0f));
    ggml_tensor * in_k = ggml_step(ctx0, ggml_scale_bias(ctx0, rank, -1.0f, (float) n_expert_used - 0.5f)); // rank < k
    ggml_tensor * out  = ggml_step(ctx0, ggml_scale_bias(ctx0, ggml_add(ctx0, in_p, in_k), -1.0f, 0.5f));  // neither
    ggml_tensor * bias = ggml_scale(ctx0, out, -1e30f);                              // {1, E, S}
    cb(bias, "clover_coreset_bias", il);

    bias = ggml_repeat_4d(ctx0, ggml_reshape_3d(ctx0, bias, n_e, 1, n_s), n_e, n_w, n_s, 1);             // {E, W, S}
    return ggml_reshape_2d(ctx0, bias, n_e, n_w * n_s);
}

ggml_tensor * llama_model_clover::graph::build_layer_ffn(ggml_tensor * cur, int il) {
    // causal rows never use a coreset; cur must hold every row of the windows (not only the output rows)
    if (coreset_top_p == nullptr || cur->ne[1] != (int64_t) ubatch.n_tokens) {
        return llama_model_qwen35moe::graph::build_layer_ffn(cur, il);
    }
    // the router logits and probabilities exactly as build_moe_ffn computes them
    ggml_tensor * logits = build_lora_mm(model.layers[il].ffn_gate_inp, cur);      // {E, T}
    cb(logits, "clover_coreset_logits", il);
    if (fused_w > 0) {
        // a fused pass: the window's rows (the last fused_w) route inside its coreset, the causal rows per row
        const int64_t n_c = cur->ne[1] - fused_w;
        ggml_tensor * causal = ggml_view_2d(ctx0, logits, n_expert, n_c, logits->nb[1], 0);
        ggml_tensor * window = ggml_view_2d(ctx0, logits, n_expert, fused_w, logits->nb[1], n_c * logits->nb[1]);
        ggml_tensor * bias   = build_coreset_bias(ggml_soft_max(ctx0, window), fused_w, 1, il);
        ggml_tensor * masked = ggml_concat(ctx0, causal, ggml_add(ctx0, window, bias), 1);
        cb(masked, "clover_coreset_logits_masked", il);
        return build_layer_ffn_moe(cur, il, nullptr, masked);
    }
    ggml_tensor * bias = build_coreset_bias(ggml_soft_max(ctx0, logits), ubatch.n_seq_tokens, ubatch.n_seqs, il);

    // The bias goes on the router logits, not on build_moe_ffn's selection probabilities (exp_probs_b): the rows'
    // top-k inside C is the same, and qwen35moe renormalises the chosen weights (norm_w = true), so
    // softmax-over-C weights renormalised equal causal mode's p_e / sum_chosen p_e. A selection bias would also be
    // per token here, while CUDA's fused top-k MoE kernel reads exp_probs_b as one {n_expert} vector; biased logits
    // keep that kernel's ordinary (unbiased) path, which softmaxes each row on its own.
    ggml_tensor * masked = ggml_add(ctx0, logits, bias);
    cb(masked, "clover_coreset_logits_masked", il);
    return build_layer_ffn_moe(cur, il, nullptr, masked);
}

ggml_tensor * llama_model_clover::graph::build_layer_attn_linear(
        llm_graph_input_rs * inp,
        ggml_tensor *        cur,
        int                  il) {
    if (fused_w > 0) {
        return build_layer_attn_linear_fused(inp, cur, il);
    }
    if (cparams.causal_attn) {
        return llama_model_qwen35moe::graph::build_layer_attn_linear(inp, cur, il);
    }
    return build_layer_attn_linear_block(inp, cur, il);
}

ggml_tensor * llama_model_clover::graph::build_layer_attn_linear_block(
        llm_graph_input_rs * inp,
        ggml_tensor *        cur,
        int                  il) {
    const auto * mctx_cur = inp->mctx;

    const int64_t d_inner      = hparams.ssm_d_inner;
    const int64_t n_seqs       = ubatch.n_seqs;
    const int64_t head_v_dim   = d_inner / hparams.ssm_dt_rank;
    const int64_t n_seq_tokens = ubatch.n_seq_tokens;

    GGML_ASSERT(n_seqs != 0);
    GGML_ASSERT(ubatch.equal_seqs());
    GGML_ASSERT(ubatch.n_tokens == n_seq_tokens * n_seqs);

    // 1. projections
    auto qkvz = build_qkvz(cur, il);

    // 2. the committed conv and ssm state (read only)
    const int64_t conv_kernel_size = model.layers[il].ssm_conv1d->ne[0];
    const int64_t conv_channels    = d_inner + 2 * hparams.ssm_n_group * hparams.ssm_d_state;
    ggml_tensor * conv_states = build_rs(inp, mctx_cur->get_r_l(il), hparams.n_embd_r(), n_seqs);
    conv_states = ggml_reshape_3d(ctx0, conv_states, conv_kernel_size - 1, conv_channels, n_seqs);
    cb(conv_states, "clover_conv_states", il);

    ggml_tensor * state = build_rs(inp, mctx_cur->get_s_l(il), hparams.n_embd_s(), n_seqs);
    state = ggml_reshape_4d(ctx0, state, head_v_dim, head_v_dim, hparams.ssm_dt_rank, n_seqs);

    // 3. the block mixing and the output projection, as causal mode
    ggml_tensor * mixed = build_block_mixing(qkvz.first, qkvz.second, conv_states, state, n_seq_tokens, n_seqs, il);
    cur = build_lora_mm(model.layers[il].ssm_out, mixed, model.layers[il].ssm_out_s);
    cb(cur, "linear_attn_out", il);

    return ggml_reshape_2d(ctx0, cur, n_embd, n_seq_tokens * n_seqs);
}

ggml_tensor * llama_model_clover::graph::build_block_mixing(
        ggml_tensor * qkv_mixed,
        ggml_tensor * z,
        ggml_tensor * conv_states,
        ggml_tensor * state,
        int64_t       n_seq_tokens,
        int64_t       n_seqs,
        int           il) {
    const auto & cmodel = static_cast<const llama_model_clover &>(model);
    const auto & cl     = cmodel.clover_layers[il];

    const int64_t d_inner      = hparams.ssm_d_inner;
    const int64_t head_k_dim   = hparams.ssm_d_state;
    const int64_t num_k_heads  = hparams.ssm_n_group;
    const int64_t num_v_heads  = hparams.ssm_dt_rank;
    const int64_t head_v_dim   = d_inner / num_v_heads;

    GGML_ASSERT(head_k_dim == head_v_dim);
    if (!(cl.bd_conv_right && cl.bd_logit_scale && cl.bd_history_bias && cl.bd_history_c)) {
        // clover_block_decode refuses this before decoding; a direct non-causal decode of a trunk-only file ends here
        GGML_ABORT("clover: a block pass needs the block-diffusion tensors; this GGUF is trunk-only");
    }

    ggml_tensor * conv_kernel   = model.layers[il].ssm_conv1d;
    const int64_t conv_channels = d_inner + 2 * hparams.ssm_n_group * hparams.ssm_d_state;

    // conv: the causal part over the history's conv tail ...
    ggml_tensor * qkv_t = ggml_transpose(ctx0, qkv_mixed);                  // {T, conv_dim, S}
    ggml_tensor * conv_input = ggml_concat(ctx0, conv_states, qkv_t, 0);     // {K-1+T, conv_dim, S}
    ggml_tensor * conv_left  = ggml_ssm_conv(ctx0, conv_input, conv_kernel); // {conv_dim, T, S}
    cb(conv_left, "clover_conv_left", il);

    // ... plus the right-context branch: out_t = sum_k w[k] * mixed[t+1+k], zero past the window end
    const int64_t k_r = cl.bd_conv_right->ne[0];
    ggml_tensor * xr = ggml_pad(ctx0, ggml_cont(ctx0, qkv_t), (int) k_r, 0, 0, 0);  // {T+K_r, conv_dim, S}
    xr = ggml_view_3d(ctx0, xr, n_seq_tokens + k_r - 1, conv_channels, n_seqs, xr->nb[1], xr->nb[2], xr->nb[0]);
    xr = ggml_cont(ctx0, xr);                                                        // {T+K_r-1, conv_dim, S}
    ggml_tensor * conv_right = ggml_ssm_conv(ctx0, xr, cl.bd_conv_right);            // {conv_dim, T, S}
    cb(conv_right, "clover_conv_right", il);

    ggml_tensor * conv_out = ggml_silu(ctx0, ggml_add(ctx0, conv_left, conv_right));
    cb(conv_out, "clover_conv_silu", il);

    // split and l2-normalise
    const int64_t qkv_dim = head_k_dim * num_k_heads * 2 + head_v_dim * num_v_heads;
    const size_t  nb1_qkv = ggml_row_size(conv_out->type, qkv_dim);

    ggml_tensor * q = ggml_view_4d(ctx0, conv_out, head_k_dim, num_k_heads, n_seq_tokens, n_seqs,
            ggml_row_size(conv_out->type, head_k_dim), nb1_qkv, nb1_qkv * n_seq_tokens, 0);
    ggml_tensor * k = ggml_view_4d(ctx0, conv_out, head_k_dim, num_k_heads, n_seq_tokens, n_seqs,
            ggml_row_size(conv_out->type, head_k_dim), nb1_qkv, nb1_qkv * n_seq_tokens,
            ggml_row_size(conv_out->type, head_k_dim * num_k_heads));
    ggml_tensor * v = ggml_view_4d(ctx0, conv_out, head_v_dim, num_v_heads, n_seq_tokens, n_seqs,
            ggml_row_size(conv_out->type, head_v_dim), nb1_qkv, nb1_qkv * n_seq_tokens,
            ggml_row_size(conv_out->type, 2 * head_k_dim * num_k_heads));

    const float eps_norm = hparams.f_norm_rms_eps;
    q = build_gdn_l2_norm(ctx0, q, eps_norm);
    k = build_gdn_l2_norm(ctx0, k, eps_norm);

    // key heads -> value heads, tiled: GGUF value head h' uses key head h' mod n_k
    if (num_k_heads != num_v_heads) {
        q = ggml_repeat_4d(ctx0, q, head_k_dim, num_v_heads, n_seq_tokens, n_seqs);
        k = ggml_repeat_4d(ctx0, k, head_k_dim, num_v_heads, n_seq_tokens, n_seqs);
    }

    // per-head layouts
    ggml_tensor * qp = ggml_cont(ctx0, ggml_permute(ctx0, q, 0, 2, 1, 3)); // {d, T, H_v, S}
    ggml_tensor * kp = ggml_cont(ctx0, ggml_permute(ctx0, k, 0, 2, 1, 3)); // {d, T, H_v, S}
    ggml_tensor * vt = ggml_cont(ctx0, ggml_permute(ctx0, v, 1, 2, 0, 3)); // {T, d, H_v, S}

    // history readout from the committed state: r_i = S^T (q^_i * history_readout_scale)
    ggml_tensor * r = ggml_mul_mat(ctx0, state, qp);                        // {d_v, T, H_v, S}
    r = ggml_scale(ctx0, r, hparams.clover_history_readout_scale);
    cb(r, "clover_hist_readout", il);

    // logits over W+1 units: the window rows, l_ij = bd_logit_scale_h * q^_i . k^_j ...
    ggml_tensor * kq = ggml_mul_mat(ctx0, kp, qp);                          // {T_k, T_q, H_v, S}
    kq = ggml_mul(ctx0, kq, ggml_reshape_4d(ctx0, cl.bd_logit_scale, 1, 1, num_v_heads, 1));

    // ... and the history slot, l_iH = bd_history_bias_h + bd_history_c_h * ln(W / history_rows): the same for every
    // row (it does not depend on q); W is this graph's true window width (never padded), a constant of the graph
    const float ln_w = logf((float) n_seq_tokens / (float) hparams.clover_history_rows);
    ggml_tensor * lh = ggml_add(ctx0, cl.bd_history_bias, ggml_scale(ctx0, cl.bd_history_c, ln_w)); // {H_v}
    lh = ggml_repeat_4d(ctx0, ggml_reshape_4d(ctx0, lh, 1, 1, num_v_heads, 1), 1, n_seq_tokens, num_v_heads, n_seqs);
    cb(lh, "clover_hist_logit", il);

    ggml_tensor * scores = ggml_concat(ctx0, kq, lh, 0);                    // {T+1, T, H_v, S}
    ggml_tensor * w = ggml_soft_max(ctx0, scores);
    cb(w, "clover_block_weights", il);

    // o_i = sum_j w_ij v_j + w_iH r_i
    ggml_tensor * w_blk = ggml_cont(ctx0, ggml_view_4d(ctx0, w, n_seq_tokens, n_seq_tokens, num_v_heads, n_seqs,
            w->nb[1], w->nb[2], w->nb[3], 0));
    ggml_tensor * w_h   = ggml_cont(ctx0, ggml_view_4d(ctx0, w, 1, n_seq_tokens, num_v_heads, n_seqs,
            w->nb[1], w->nb[2], w->nb[3], ggml_row_size(w->type, n_seq_tokens)));

    ggml_tensor * o = ggml_mul_mat(ctx0, vt, w_blk);                        // {d_v, T, H_v, S}
    o = ggml_add(ctx0, o, ggml_mul(ctx0, r, w_h));
    o = ggml_cont(ctx0, ggml_permute(ctx0, o, 0, 2, 1, 3));                 // {d_v, H_v, T, S}
    cb(o, "clover_block_out", il);

    // gated RMSNorm with z, as causal mode
    ggml_tensor * z_4d = ggml_reshape_4d(ctx0, z, head_v_dim, num_v_heads, n_seq_tokens, n_seqs);
    ggml_tensor * attn_out_norm = build_norm_gated(o, model.layers[il].ssm_norm, z_4d, il);
    return ggml_reshape_3d(ctx0, attn_out_norm, head_v_dim * num_v_heads, n_seq_tokens, n_seqs);
}

// A fused verify + draft pass's GDN layer (docs/native.md, "The fused pass"): one sequence's ubatch of n_c causal rows
// followed by a block window of fused_w rows. The causal rows are causal mode, qwen35moe's GDN (conv, then the gated
// delta rule), and write the recurrent state as a pass of the whole ubatch would, except at the window's own
// positions: group g (the state g rows before the ubatch's end) gets the causal rows' state g - fused_w rows before
// their end, and the window's groups (g < fused_w) are not written. The engine removes the window after every fused
// pass (seq_rm), which always selects a group >= fused_w. The window is block mode over the conv tail and the ssm
// state that the causal rows leave, read in the same graph.
ggml_tensor * llama_model_clover::graph::build_layer_attn_linear_fused(
        llm_graph_input_rs * inp,
        ggml_tensor *        cur,
        int                  il) {
    const auto * mctx_cur = inp->mctx;

    const int64_t d_inner     = hparams.ssm_d_inner;
    const int64_t head_k_dim  = hparams.ssm_d_state;
    const int64_t num_k_heads = hparams.ssm_n_group;
    const int64_t num_v_heads = hparams.ssm_dt_rank;
    const int64_t head_v_dim  = d_inner / num_v_heads;
    const int64_t n_tokens    = ubatch.n_seq_tokens;
    const int64_t n_w         = fused_w;
    const int64_t n_c         = n_tokens - n_w;
    const int64_t K           = (int64_t) cparams.n_rs_seq + 1;  // snapshot groups

    GGML_ASSERT(ubatch.n_seqs == 1 && n_c > 0 && K > n_tokens - 1);

    // projections of every row; the causal rows' gates, as qwen35moe computes them
    auto qkvz = build_qkvz(cur, il);
    ggml_tensor * qkv_mixed = qkvz.first;   // {conv_dim, T, 1}
    ggml_tensor * z         = qkvz.second;  // {d_inner, T}
    ggml_tensor * qkv_c = ggml_view_3d(ctx0, qkv_mixed, qkv_mixed->ne[0], n_c, 1, qkv_mixed->nb[1], qkv_mixed->nb[2], 0);
    ggml_tensor * qkv_w = ggml_view_3d(ctx0, qkv_mixed, qkv_mixed->ne[0], n_w, 1, qkv_mixed->nb[1], qkv_mixed->nb[2],
            n_c * qkv_mixed->nb[1]);
    ggml_tensor * z_c = ggml_view_2d(ctx0, z, z->ne[0], n_c, z->nb[1], 0);
    ggml_tensor * z_w = ggml_view_2d(ctx0, z, z->ne[0], n_w, z->nb[1], n_c * z->nb[1]);
    ggml_tensor * cur_c = ggml_view_2d(ctx0, cur, cur->ne[0], n_c, cur->nb[1], 0);

    ggml_tensor * beta = build_lora_mm(model.layers[il].ssm_beta, cur_c, model.layers[il].ssm_beta_s);
    beta = ggml_sigmoid(ctx0, ggml_reshape_4d(ctx0, beta, 1, num_v_heads, n_c, 1));
    ggml_tensor * alpha = build_lora_mm(model.layers[il].ssm_alpha, cur_c, model.layers[il].ssm_alpha_s);
    alpha = ggml_reshape_3d(ctx0, alpha, num_v_heads, n_c, 1);
    ggml_tensor * gate = ggml_mul(ctx0, ggml_softplus(ctx0, ggml_add(ctx0, alpha, model.layers[il].ssm_dt)),
            model.layers[il].ssm_a);
    gate = ggml_reshape_4d(ctx0, gate, 1, num_v_heads, n_c, 1);

    // the causal rows' conv over the committed conv state, and its snapshot groups
    ggml_tensor * conv_states_all  = mctx_cur->get_r_l(il);
    ggml_tensor * ssm_states_all   = mctx_cur->get_s_l(il);
    ggml_tensor * conv_kernel      = model.layers[il].ssm_conv1d;
    const int64_t conv_kernel_size = conv_kernel->ne[0];
    const int64_t conv_channels    = d_inner + 2 * hparams.ssm_n_group * hparams.ssm_d_state;
    const auto    kv_head          = mctx_cur->get_head();
    const auto    mem_size         = mctx_cur->get_size();

    ggml_tensor * conv_states = build_rs(inp, conv_states_all, hparams.n_embd_r(), 1);
    conv_states = ggml_reshape_3d(ctx0, conv_states, conv_kernel_size - 1, conv_channels, 1);
    ggml_tensor * conv_input = ggml_concat(ctx0, conv_states, ggml_transpose(ctx0, qkv_c), 0);  // {K-1+C, conv_dim, 1}
    cb(conv_input, "clover_fused_conv_input", il);

    const int64_t row_count = (conv_kernel_size - 1) * conv_channels;
    const size_t  conv_row  = ggml_row_size(conv_states_all->type, row_count);
    // the groups of the causal rows' own tokens, as llama.cpp's build_conv_state writes a ubatch's (patch 0010)
    for (int64_t g = n_w; g < std::min<int64_t>(K, n_tokens); ++g) {
        const int64_t s_idx = n_tokens - g;  // in 1 .. n_c
        ggml_tensor * src = ggml_view_3d(ctx0, conv_input, conv_kernel_size - 1, conv_channels, 1,
                conv_input->nb[1], conv_input->nb[2], ggml_row_size(conv_input->type, s_idx));
        ggml_tensor * dst = ggml_view_2d(ctx0, conv_states_all, row_count, 1, conv_states_all->nb[1],
                ((size_t) g * mem_size + kv_head) * conv_row);
        ggml_build_forward_expand(gf, ggml_cpy(ctx0, src, dst));
    }

    ggml_tensor * conv_out = ggml_silu(ctx0, ggml_ssm_conv(ctx0, conv_input, conv_kernel));  // {conv_dim, C, 1}
    const int64_t qkv_dim = head_k_dim * num_k_heads * 2 + head_v_dim * num_v_heads;
    const size_t  nb1_qkv = ggml_row_size(conv_out->type, qkv_dim);
    ggml_tensor * q = ggml_view_4d(ctx0, conv_out, head_k_dim, num_k_heads, n_c, 1,
            ggml_row_size(conv_out->type, head_k_dim), nb1_qkv, nb1_qkv * n_c, 0);
    ggml_tensor * k = ggml_view_4d(ctx0, conv_out, head_k_dim, num_k_heads, n_c, 1,
            ggml_row_size(conv_out->type, head_k_dim), nb1_qkv, nb1_qkv * n_c,
            ggml_row_size(conv_out->type, head_k_dim * num_k_heads));
    ggml_tensor * v = ggml_view_4d(ctx0, conv_out, head_v_dim, num_v_heads, n_c, 1,
            ggml_row_size(conv_out->type, head_v_dim), nb1_qkv, nb1_qkv * n_c,
            ggml_row_size(conv_out->type, 2 * head_k_dim * num_k_heads));
    q = build_gdn_l2_norm(ctx0, q, hparams.f_norm_rms_eps);
    k = build_gdn_l2_norm(ctx0, k, hparams.f_norm_rms_eps);

    // the gated delta rule over the causal rows (the fused op tiles key heads over value heads), and its snapshots:
    // op slot s (s rows before the causal rows' end) -> group s + n_w
    ggml_tensor * state = build_rs(inp, ssm_states_all, hparams.n_embd_s(), 1);
    state = ggml_reshape_4d(ctx0, state, head_v_dim, head_v_dim, num_v_heads, 1);
    ggml_tensor * gdn = ggml_gated_delta_net(ctx0, q, k, v, gate, beta, state, K);
    res->add_fused_node({n_c > 1 ? LLM_FUSED_OP_GDN_CH : LLM_FUSED_OP_GDN_AR, gdn, il});
    cb(gdn, "clover_fused_gdn", il);

    const int64_t D         = head_v_dim * head_v_dim * num_v_heads;
    const size_t  out_bytes = ggml_row_size(gdn->type, head_v_dim * num_v_heads * n_c);
    const size_t  ssm_row   = hparams.n_embd_s() * ggml_element_size(ssm_states_all);
    const int64_t n_snap    = std::min<int64_t>(n_c, K - n_w);
    ggml_tensor * snaps = ggml_view_3d(ctx0, gdn, D, 1, n_snap, ggml_row_size(gdn->type, D), ggml_row_size(gdn->type, D),
            out_bytes);
    ggml_tensor * groups = ggml_view_3d(ctx0, ssm_states_all, D, 1, n_snap, ssm_states_all->nb[1],
            (size_t) mem_size * ssm_row, ((size_t) n_w * mem_size + kv_head) * ssm_row);
    ggml_build_forward_expand(gf, ggml_cpy(ctx0, snaps, groups));

    ggml_tensor * out_c = ggml_view_4d(ctx0, gdn, head_v_dim, num_v_heads, n_c, 1, ggml_row_size(gdn->type, head_v_dim),
            ggml_row_size(gdn->type, head_v_dim * num_v_heads), out_bytes, 0);
    out_c = build_norm_gated(out_c, model.layers[il].ssm_norm, ggml_reshape_4d(ctx0, z_c, head_v_dim, num_v_heads, n_c, 1), il);
    out_c = ggml_reshape_3d(ctx0, out_c, d_inner, n_c, 1);

    // the window: block mixing over the conv tail and the final state the causal rows leave
    ggml_tensor * conv_tail = ggml_view_3d(ctx0, conv_input, conv_kernel_size - 1, conv_channels, 1, conv_input->nb[1],
            conv_input->nb[2], ggml_row_size(conv_input->type, n_c));
    ggml_tensor * state_w = ggml_view_4d(ctx0, gdn, head_v_dim, head_v_dim, num_v_heads, 1,
            ggml_row_size(gdn->type, head_v_dim), ggml_row_size(gdn->type, head_v_dim * head_v_dim),
            ggml_row_size(gdn->type, D), out_bytes);
    ggml_tensor * out_w = build_block_mixing(qkv_w, z_w, conv_tail, state_w, n_w, 1, il);

    ggml_tensor * mixed = ggml_concat(ctx0, out_c, out_w, 1);  // {d_inner, T, 1}
    cur = build_lora_mm(model.layers[il].ssm_out, mixed, model.layers[il].ssm_out_s);
    cb(cur, "linear_attn_out", il);
    return ggml_reshape_2d(ctx0, cur, n_embd, n_tokens);
}

//
// the clover model's C functions (declared in src/llama-clover.h)
//

static const llama_model_clover * clover_model_of(const struct llama_model * model) {
    return model ? dynamic_cast<const llama_model_clover *>(model) : nullptr;
}

float llama_clover_gguf_coreset_top_p(const struct llama_model * model) {
    const llama_model_clover * m = clover_model_of(model);
    return m ? m->hparams.clover_coreset_top_p : -1.0f;
}

bool llama_clover_has_block_diffusion(const struct llama_model * model) {
    const llama_model_clover * m = clover_model_of(model);
    return m != nullptr && m->hparams.clover_has_block_diffusion;
}

int32_t llama_clover_block_size(const struct llama_model * model) {
    const llama_model_clover * m = clover_model_of(model);
    return m != nullptr && m->hparams.clover_has_block_diffusion ? (int32_t) m->hparams.clover_block_size : 0;
}

float llama_clover_threshold(const struct llama_model * model, int32_t block_size) {
    const llama_model_clover * m = clover_model_of(model);
    if (m == nullptr) {
        return -1.0f;
    }
    for (size_t i = 0; i < m->clover_calibrated_block_sizes.size(); ++i) {
        if ((int64_t) m->clover_calibrated_block_sizes[i] == block_size) {
            return m->clover_calibrated_thresholds[i];
        }
    }
    return m->hparams.clover_threshold;
}

bool llama_clover_block_begin(struct llama_context * ctx, const llama_seq_id * history, const llama_seq_id * scratch,
                              int32_t n) {
    llama_memory_t mem = llama_get_memory(ctx);
    for (int32_t i = 0; i < n; ++i) {
        llama_memory_seq_rm(mem, scratch[i], -1, -1);
        llama_memory_seq_cp(mem, history[i], scratch[i], -1, -1);
        llama_set_seq_param(ctx, scratch[i], LLAMA_CLOVER_PARAM_CORESET_TOP_P,
                            llama_get_seq_param(ctx, history[i], LLAMA_CLOVER_PARAM_CORESET_TOP_P));
    }
    const bool causal = llama_get_causal_attn(ctx);
    llama_set_causal_attn(ctx, false);
    return causal;
}

void llama_clover_block_end(struct llama_context * ctx, const llama_seq_id * scratch, int32_t n, bool causal) {
    llama_set_causal_attn(ctx, causal);
    llama_memory_t mem = llama_get_memory(ctx);
    for (int32_t i = 0; i < n; ++i) {
        llama_memory_seq_rm(mem, scratch[i], -1, -1);
    }
}

bool llama_clover_attach_block_diffusion(struct llama_model * model, const char * path, char * err, size_t err_size) {
    auto * m = model ? dynamic_cast<llama_model_clover *>(model) : nullptr;
    std::string msg;
    if (m == nullptr || path == nullptr) {
        msg = "not a clover_moe model, or no sidecar path";
    } else {
        try {
            m->attach_block_diffusion(path);
        } catch (const std::exception & e) {
            msg = std::string("sidecar '") + path + "': " + e.what();
        }
    }
    if (err != nullptr && err_size > 0) {
        snprintf(err, err_size, "%s", msg.c_str());
    }
    if (!msg.empty()) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, msg.c_str());
    }
    return msg.empty();
}
