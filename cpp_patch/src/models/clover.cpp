// Clover: block-diffusion MoE on the Qwen3.5-MoE (qwen35moe) trunk.
//
// Causal mode (cparams.causal_attn == true) is qwen35moe's graph, unchanged: this class derives from
// llama_model_qwen35moe and only overrides the GDN layer, which forwards to qwen35moe in causal mode.
//
// Block mode (cparams.causal_attn == false; spec section 3) runs a window of B positions on top of the
// committed history. Attention layers are qwen35moe's, made non-causal by llama.cpp's mask. GDN layers:
//   u      = causal conv(history conv state ++ mixed) + right conv(mixed[1:] ++ zeros)   (before SiLU)
//   q^, k^ = l2norm(q), l2norm(k); key heads tiled to value heads (GGUF value-head order)
//   r_i    = S^T q^_i / sqrt(d_k)                       (committed ssm state, read only)
//   l_ij   = blk_scale_h * q^_i . k^_j,  l_iH = q^_i . hist_h + hist_b_h
//   o_i    = softmax over {j, H}: sum_j w_ij v_j + w_iH r_i, then gated RMSNorm(z) and ssm_out.
// Block mode reads the recurrent state (conv and ssm) and never writes it.

#include "models.h"
#include "llama-memory-recurrent.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

// the largest block size a GGUF may declare (clover.block_size, calibrated sizes); the converter refuses the same
// (reference/config.py MAX_BLOCK_SIZE): every block size needs B-1 rollback states of the recurrent memory
static constexpr uint32_t CLOVER_MAX_BLOCK_SIZE = 256;

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

    ml.get_key(LLM_KV_DFLASH_BLOCK_SIZE,            hparams.clover_block_size);        // clover.block_size
    ml.get_key(LLM_KV_CLOVER_SSM_CONV_RIGHT_KERNEL, hparams.clover_conv_right_kernel); // clover.ssm.conv_right_kernel
    ml.get_key(LLM_KV_CLOVER_DIFFUSION_THRESHOLD,   hparams.clover_threshold, false);

    uint32_t mask_id = 0;
    ml.get_key(LLM_KV_TOKENIZER_MASK_ID, mask_id);
    hparams.clover_mask_token_id = (int32_t) mask_id;

    clover_calibrated_block_sizes.clear();
    clover_calibrated_thresholds.clear();
    ml.get_arr(LLM_KV_CLOVER_CALIBRATED_BLOCK_SIZES, clover_calibrated_block_sizes, false);
    ml.get_arr(LLM_KV_CLOVER_CALIBRATED_THRESHOLDS,  clover_calibrated_thresholds,  false);

    if (hparams.clover_block_size == 0 || hparams.clover_block_size > CLOVER_MAX_BLOCK_SIZE) {
        clover_bad_key(ml, LLM_KV_DFLASH_BLOCK_SIZE, "= " + std::to_string(hparams.clover_block_size) +
                " must be in 1 .. " + std::to_string(CLOVER_MAX_BLOCK_SIZE));
    }
    if (!(hparams.clover_threshold >= 0.0f && hparams.clover_threshold <= 1.0f)) {  // NaN fails too
        clover_bad_key(ml, LLM_KV_CLOVER_DIFFUSION_THRESHOLD, "= " + std::to_string(hparams.clover_threshold) +
                " must be in [0, 1]");
    }
    for (float t : clover_calibrated_thresholds) {
        if (!(t >= 0.0f && t <= 1.0f)) {
            clover_bad_key(ml, LLM_KV_CLOVER_CALIBRATED_THRESHOLDS, "holds " + std::to_string(t) +
                    "; thresholds must be in [0, 1]");
        }
    }
    check_trunk_hparams(ml);
    if (!clover_kernel_supported(hparams.clover_conv_right_kernel)) {
        throw std::runtime_error("clover: clover.ssm.conv_right_kernel = " +
                std::to_string(hparams.clover_conv_right_kernel) + " is not supported (supported: 3, 4, 5, 9, 15)");
    }
    if (clover_calibrated_block_sizes.size() != clover_calibrated_thresholds.size()) {
        throw std::runtime_error("clover: clover.diffusion.calibrated_block_sizes and calibrated_thresholds differ in length");
    }
    for (uint32_t b : clover_calibrated_block_sizes) {
        if (b == 0 || b > CLOVER_MAX_BLOCK_SIZE) {
            clover_bad_key(ml, LLM_KV_CLOVER_CALIBRATED_BLOCK_SIZES, "holds " + std::to_string(b) +
                    "; block sizes must be in 1 .. " + std::to_string(CLOVER_MAX_BLOCK_SIZE));
        }
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

    if (hparams.clover_mask_token_id < 0 || (int64_t) hparams.clover_mask_token_id >= n_vocab) {
        throw std::runtime_error("clover: tokenizer.ggml.mask_token_id = " + std::to_string(hparams.clover_mask_token_id) +
                " is out of range (n_vocab = " + std::to_string(n_vocab) + ")");
    }

    const int64_t head_k_dim = hparams.ssm_d_state;
    const int64_t n_k_heads  = hparams.ssm_n_group;
    const int64_t n_v_heads  = hparams.ssm_dt_rank;
    const int64_t key_dim    = head_k_dim * n_k_heads;
    const int64_t value_dim  = head_k_dim * n_v_heads;
    const int64_t conv_dim   = key_dim * 2 + value_dim;
    const int64_t k_r        = hparams.clover_conv_right_kernel;

    clover_layers.assign(n_layer_all, clover_layer{});

    auto check_f32 = [](const ggml_tensor * t) {
        if (t != nullptr && t->type != GGML_TYPE_F32) {
            throw std::runtime_error(std::string("clover: tensor '") + ggml_get_name(t) + "' must be F32, got " +
                    ggml_type_name(t->type));
        }
    };

    for (int il = 0; il < n_layer; ++il) {
        if (!hparams.is_recr(il)) {
            continue;
        }
        auto & cl = clover_layers[il];
        cl.ssm_conv1d_right = create_tensor(tn(LLM_TENSOR_SSM_CONV1D_RIGHT, "weight", il), { k_r, conv_dim }, 0);
        cl.ssm_hist         = create_tensor(tn(LLM_TENSOR_SSM_HIST,         "weight", il), { head_k_dim, n_v_heads }, 0);
        cl.ssm_hist_b       = create_tensor(tn(LLM_TENSOR_SSM_HIST,         "bias",   il), { n_v_heads }, 0);
        cl.ssm_blk_scale    = create_tensor(tn(LLM_TENSOR_SSM_BLK_SCALE,    "weight", il), { n_v_heads }, 0);
        check_f32(cl.ssm_conv1d_right);
        check_f32(cl.ssm_hist);
        check_f32(cl.ssm_hist_b);
        check_f32(cl.ssm_blk_scale);
    }
}

std::unique_ptr<llm_graph_context> llama_model_clover::build_arch_graph(const llm_graph_params & params) const {
    if (params.gtype == LLM_GRAPH_TYPE_DECODER_MTP) {
        throw std::runtime_error("clover: no MTP graph");
    }
    return std::make_unique<graph>(*this, params);
}

llama_model_clover::graph::graph(const llama_model & model, const llm_graph_params & params) :
    llama_model_qwen35moe::graph(model, params, defer_build{}) {
    build();
}

ggml_tensor * llama_model_clover::graph::build_layer_attn_linear(
        llm_graph_input_rs * inp,
        ggml_tensor *        cur,
        int                  il) {
    if (cparams.causal_attn) {
        return llama_model_qwen35moe::graph::build_layer_attn_linear(inp, cur, il);
    }
    return build_layer_attn_linear_block(inp, cur, il);
}

ggml_tensor * llama_model_clover::graph::build_layer_attn_linear_block(
        llm_graph_input_rs * inp,
        ggml_tensor *        cur,
        int                  il) {
    const auto & cmodel = static_cast<const llama_model_clover &>(model);
    const auto & cl     = cmodel.clover_layers[il];
    const auto * mctx_cur = inp->mctx;

    const int64_t d_inner      = hparams.ssm_d_inner;
    const int64_t n_seqs       = ubatch.n_seqs;
    const int64_t head_k_dim   = hparams.ssm_d_state;
    const int64_t num_k_heads  = hparams.ssm_n_group;
    const int64_t num_v_heads  = hparams.ssm_dt_rank;
    const int64_t head_v_dim   = d_inner / num_v_heads;
    const int64_t n_seq_tokens = ubatch.n_seq_tokens;

    GGML_ASSERT(n_seqs != 0);
    GGML_ASSERT(ubatch.equal_seqs());
    GGML_ASSERT(ubatch.n_tokens == n_seq_tokens * n_seqs);
    GGML_ASSERT(head_k_dim == head_v_dim);
    GGML_ASSERT(cl.ssm_conv1d_right && cl.ssm_hist && cl.ssm_hist_b && cl.ssm_blk_scale);

    // 1. projections
    auto qkvz = build_qkvz(cur, il);
    ggml_tensor * qkv_mixed = qkvz.first;   // {conv_dim, T, S}
    ggml_tensor * z         = qkvz.second;

    ggml_tensor * conv_states_all = mctx_cur->get_r_l(il);
    ggml_tensor * ssm_states_all  = mctx_cur->get_s_l(il);

    ggml_tensor * conv_kernel      = model.layers[il].ssm_conv1d;
    const int64_t conv_kernel_size = conv_kernel->ne[0];
    const int64_t conv_channels    = d_inner + 2 * hparams.ssm_n_group * hparams.ssm_d_state;

    // 2. conv: causal part with the committed conv state (read only) ...
    ggml_tensor * conv_states = build_rs(inp, conv_states_all, hparams.n_embd_r(), n_seqs);
    conv_states = ggml_reshape_3d(ctx0, conv_states, conv_kernel_size - 1, conv_channels, n_seqs);
    cb(conv_states, "clover_conv_states", il);

    ggml_tensor * qkv_t = ggml_transpose(ctx0, qkv_mixed);                  // {T, conv_dim, S}
    ggml_tensor * conv_input = ggml_concat(ctx0, conv_states, qkv_t, 0);     // {K-1+T, conv_dim, S}
    ggml_tensor * conv_left  = ggml_ssm_conv(ctx0, conv_input, conv_kernel); // {conv_dim, T, S}
    cb(conv_left, "clover_conv_left", il);

    // ... plus the right-context branch: out_t = sum_k w[k] * mixed[t+1+k], zero past the window end
    const int64_t k_r = cl.ssm_conv1d_right->ne[0];
    ggml_tensor * xr = ggml_pad(ctx0, ggml_cont(ctx0, qkv_t), (int) k_r, 0, 0, 0);  // {T+K_r, conv_dim, S}
    xr = ggml_view_3d(ctx0, xr, n_seq_tokens + k_r - 1, conv_channels, n_seqs, xr->nb[1], xr->nb[2], xr->nb[0]);
    xr = ggml_cont(ctx0, xr);                                                        // {T+K_r-1, conv_dim, S}
    ggml_tensor * conv_right = ggml_ssm_conv(ctx0, xr, cl.ssm_conv1d_right);         // {conv_dim, T, S}
    cb(conv_right, "clover_conv_right", il);

    ggml_tensor * conv_out = ggml_silu(ctx0, ggml_add(ctx0, conv_left, conv_right));
    cb(conv_out, "clover_conv_silu", il);

    // 3. split and l2-normalise
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

    // 4. history readout from the committed state: r_i = S^T q^_i / sqrt(d_k)
    ggml_tensor * state = build_rs(inp, ssm_states_all, hparams.n_embd_s(), n_seqs);
    state = ggml_reshape_4d(ctx0, state, head_v_dim, head_v_dim, num_v_heads, n_seqs);
    ggml_tensor * r = ggml_mul_mat(ctx0, state, qp);                        // {d_v, T, H_v, S}
    r = ggml_scale(ctx0, r, 1.0f / sqrtf((float) head_k_dim));
    cb(r, "clover_hist_readout", il);

    // 5. scores over B+1 units
    ggml_tensor * kq = ggml_mul_mat(ctx0, kp, qp);                          // {T_k, T_q, H_v, S}
    kq = ggml_mul(ctx0, kq, ggml_reshape_4d(ctx0, cl.ssm_blk_scale, 1, 1, num_v_heads, 1));

    ggml_tensor * lh = ggml_mul_mat(ctx0, ggml_reshape_4d(ctx0, cl.ssm_hist, head_k_dim, 1, num_v_heads, 1), qp); // {1, T, H_v, S}
    lh = ggml_add(ctx0, lh, ggml_reshape_4d(ctx0, cl.ssm_hist_b, 1, 1, num_v_heads, 1));

    ggml_tensor * scores = ggml_concat(ctx0, kq, lh, 0);                    // {T+1, T, H_v, S}
    ggml_tensor * w = ggml_soft_max(ctx0, scores);
    cb(w, "clover_block_weights", il);

    // 6. o_i = sum_j w_ij v_j + w_iH r_i
    ggml_tensor * w_blk = ggml_cont(ctx0, ggml_view_4d(ctx0, w, n_seq_tokens, n_seq_tokens, num_v_heads, n_seqs,
            w->nb[1], w->nb[2], w->nb[3], 0));
    ggml_tensor * w_h   = ggml_cont(ctx0, ggml_view_4d(ctx0, w, 1, n_seq_tokens, num_v_heads, n_seqs,
            w->nb[1], w->nb[2], w->nb[3], ggml_row_size(w->type, n_seq_tokens)));

    ggml_tensor * o = ggml_mul_mat(ctx0, vt, w_blk);                        // {d_v, T, H_v, S}
    o = ggml_add(ctx0, o, ggml_mul(ctx0, r, w_h));
    o = ggml_cont(ctx0, ggml_permute(ctx0, o, 0, 2, 1, 3));                 // {d_v, H_v, T, S}
    cb(o, "clover_block_out", il);

    // 7. gated RMSNorm with z and the output projection, as causal mode
    ggml_tensor * z_4d = ggml_reshape_4d(ctx0, z, head_v_dim, num_v_heads, n_seq_tokens, n_seqs);
    ggml_tensor * attn_out_norm = build_norm_gated(o, model.layers[il].ssm_norm, z_4d, il);

    ggml_tensor * final_output = ggml_reshape_3d(ctx0, attn_out_norm, head_v_dim * num_v_heads, n_seq_tokens, n_seqs);
    cur = build_lora_mm(model.layers[il].ssm_out, final_output, model.layers[il].ssm_out_s);
    cb(cur, "linear_attn_out", il);

    return ggml_reshape_2d(ctx0, cur, n_embd, n_seq_tokens * n_seqs);
}
