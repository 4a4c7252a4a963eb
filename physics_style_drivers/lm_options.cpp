#include "parallel/planner.hpp"
#include "lm_options.hpp"

#include <filesystem>
#include <limits>

#include "core/error.hpp"
#include "moe/router.hpp"
#include "tensor/gemm.hpp"

namespace mm::drivers {

using I = std::int64_t;

void declare_run(io::Deck& d) {
  d.add<std::string>("run.driver", "genomics_lm", "workload to run (see mambamoe --list-drivers)")
      .add<I>("run.seed", 1, "seed of every random draw (initialisation, data order)")
      .add<bool>("run.deterministic", true,
                 "bit-identical results between runs on the same hardware and layout (the CPU kernels always are: "
                 "no atomics in any reduction)")
      .add<std::string>("run.output_dir", "runs/default", "directory for metrics and checkpoints (created)")
      .add<std::string>("run.gemm_precision", "fp32",
                        "CUDA: arithmetic of the layers' float weight GEMMs: fp32, tf32 or bf16 (tensor cores, fp32 "
                        "accumulation); CPU builds compute in fp32. bf16 also puts the MoE experts on their bf16 "
                        "path (bf16 expert inputs, weights and intermediates; emulated on CPU builds)");
  d.add<I>("parallel.tp", 1,
           "tensor-parallel ranks: heads, groups and feed-forward widths are split over them (they divide by tp)")
      .add<I>("parallel.cp", 1,
              "context-parallel ranks: every sequence is split into cp contiguous slices (seq_len divides by cp), "
              "the mixers pass their states between the slices")
      .add<I>("parallel.ep", 1,
              "expert-parallel ranks: the experts of every MoE layer are split over them (n_experts divides by ep); "
              "they hold different micro-batches like dp ranks")
      .add<I>("parallel.dp", 0,
              "data-parallel ranks (0: the rest); tp * cp * ep * dp = MPI ranks; grad_accum divides by ep * dp")
      .add<std::string>("parallel.layout", "manual",
                        "manual: tp, cp, ep, dp as given | auto: the planner picks them and the recompute policy from "
                        "the model, seq_len, batch and gpu_memory_gb (it prints its choice and memory estimate)")
      .add<double>("parallel.gpu_memory_gb", 141.0, "layout = auto: device memory per rank in GB (H200: 141)")
      .add<I>("parallel.plan_gpus", 0,
              "N > 0: print the planner's layout and memory estimate per rank for N GPUs and exit without reading "
              "data or training (layout = auto: its choice; manual: the deck's tp, cp, ep, with dp the rest)")
      .add<std::string>("parallel.backend", "mpi",
                        "communicator transport: mpi (host memory; device buffers are staged through the host) | "
                        "nccl (device memory, on Kokkos' CUDA stream; host buffers are staged through the device; "
                        "needs a CUDA build with NCCL and one GPU per rank)")
      .add<bool>("parallel.zero1", false,
                 "ZeRO-1: shard the AdamW moments over the dp ranks (each updates 1/dp of the parameters, which are "
                 "then all-gathered); results are bit-identical to plain dp")
      .add<bool>("parallel.overlap_grad_reduce", true,
                 "ep * dp > 1, language models: exchange each bucket of the per-micro-batch gradients as soon as the "
                 "backward has passed its parameters (overlapped with the rest of the backward; NCCL: on a side "
                 "stream); false: all buckets after the backward. Bit-identical results either way");
}

namespace {
// What the planner needs from the deck, for `gpus` ranks.
parallel::PlanInput plan_input(const io::Deck& d, I gpus) {
  parallel::PlanInput in;
  in.model = parallel::plan_model(make_lm_config(d));
  in.seqlen = d.get<I>("train.seq_len");
  in.global_batch = d.get<I>("train.batch_size") * d.get<I>("train.grad_accum");
  in.gpus = gpus;
  // the held-out evaluation that the run does at least once, at the end
  in.eval_batch = d.get<I>("train.eval_batch_size");
  in.eval_seqlen = d.get<I>("train.eval_seq_len");
  in.gpu_memory_bytes = d.get<double>("parallel.gpu_memory_gb") * 1e9;
  require(in.gpu_memory_bytes > 0, "[parallel] gpu_memory_gb", "the planner needs the device memory per rank");
  // the MoE layers' bf16 expert path (its activations and weight copies)
  in.moe_bf16 = parse_gemm_compute(d.get<std::string>("run.gemm_precision"), "[run] gemm_precision") ==
                GemmCompute::bf16;
  return in;
}

// layout = auto: the planner's choice for this deck and this many ranks (computed once)
const parallel::Plan* auto_plan(const io::Deck& d) {
  static std::unique_ptr<parallel::Plan> plan;
  if (d.get<std::string>("parallel.layout") != "auto") return nullptr;
  if (!plan) {
    int world = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    plan = std::make_unique<parallel::Plan>(parallel::plan(plan_input(d, world)));
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) std::printf("layout = auto (%d ranks):\n%s\n", world, parallel::describe(*plan).c_str());
  }
  return plan.get();
}

// [model] ssd_algorithm and ssd_precision: the M2 layers' chunked scan, and the M3 layers' SISO scan (which runs
// on the same kernels).
void parse_ssd_choice(const io::Deck& d, SSDAlgo& algo, GemmCompute& compute) {
  const std::string where = d.path().empty() ? "[model]" : d.path() + " [model]";
  const std::string a = d.get<std::string>("model.ssd_algorithm");
  require(a == "auto" || a == "portable" || a == "gemm" || a == "fused", where, "model.ssd_algorithm: unknown value '",
          a, "' (valid: auto, portable, gemm, fused)");
  algo = a == "gemm"       ? SSDAlgo::gemm
         : a == "fused"    ? SSDAlgo::fused
         : a == "portable" ? SSDAlgo::portable
                           : SSDAlgo::automatic;
  compute = parse_gemm_compute(d.get<std::string>("model.ssd_precision"), where + " model.ssd_precision");
}

}  // namespace

std::shared_ptr<const parallel::ProcessGrid> make_process_grid(const io::Deck& d) {
  // one grid per process (its communicators are collective to create)
  static std::shared_ptr<const parallel::ProcessGrid> grid;
  if (!grid) {
    parallel::Layout l;
    const std::string mode = d.get<std::string>("parallel.layout");
    require(mode == "manual" || mode == "auto", "[parallel] layout", "'", mode, "' is not one of: manual auto");
    if (const auto* p = auto_plan(d)) {
      l = p->layout;
    } else {
      l.tp = d.get<I>("parallel.tp");
      l.cp = d.get<I>("parallel.cp");
      l.ep = d.get<I>("parallel.ep");
      l.dp = d.get<I>("parallel.dp");
    }
    const std::string backend = d.get<std::string>("parallel.backend");
    require(backend == "mpi" || backend == "nccl", "[parallel] backend", "'", backend, "' is not one of: mpi nccl");
    grid = std::make_shared<parallel::ProcessGrid>(
        l, MPI_COMM_WORLD, backend == "nccl" ? parallel::Backend::nccl : parallel::Backend::mpi);
  }
  return grid;
}

parallel::Plan deck_plan(const io::Deck& d, std::int64_t gpus) {
  const parallel::PlanInput in = plan_input(d, gpus);
  parallel::Plan p;
  if (d.get<std::string>("parallel.layout") == "auto") {
    p = parallel::plan(in);
  } else {
    parallel::Layout l;
    l.tp = d.get<I>("parallel.tp");
    l.cp = d.get<I>("parallel.cp");
    l.ep = d.get<I>("parallel.ep");
    const I split = l.tp * l.cp * l.ep;
    require(split >= 1 && gpus % split == 0, "[parallel] plan_gpus", gpus, " GPUs do not divide by tp * cp * ep = ",
            split);
    l.dp = d.get<I>("parallel.dp") > 0 ? d.get<I>("parallel.dp") : gpus / split;
    require(l.tp * l.cp * l.ep * l.dp == gpus, "[parallel] plan_gpus", "tp * cp * ep * dp = ",
            l.tp * l.cp * l.ep * l.dp, " is not ", gpus);
    const std::string rc = d.get<std::string>("train.recompute");
    require(rc == "none" || rc == "mixer", "[train] recompute", "unknown policy '", rc, "'; valid: none mixer");
    p = parallel::estimate(in, l, d.get<I>("train.batch_size"), rc == "none" ? Recompute::none : Recompute::mixer);
  }
  return p;
}

bool print_plan_only(const io::Deck& d) {
  const I gpus = d.get<I>("parallel.plan_gpus");
  if (gpus <= 0) return false;
  const parallel::PlanInput in = plan_input(d, gpus);
  const parallel::Plan p = deck_plan(d, gpus);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0)
    std::printf("plan for %lld GPUs of %.0f GB, %lld tokens per sequence, %lld sequences per step (%s layout):\n%s\n",
                (long long)gpus, in.gpu_memory_bytes / 1e9, (long long)in.seqlen, (long long)in.global_batch,
                d.get<std::string>("parallel.layout").c_str(), parallel::describe(p).c_str());
  return true;
}

void require_data_parallel_only(const io::Deck& d, const std::string& what) {
  const auto& l = make_process_grid(d)->layout();
  require(l.tp == 1 && l.cp == 1 && l.ep == 1, "[parallel]", what, " runs data-parallel only (tp = cp = ep = 1); got tp = ",
          l.tp, ", cp = ", l.cp, ", ep = ", l.ep);
}

void declare_backbone_options(io::Deck& d) {
  const Mamba2Config m;
  d.add<I>("model.d_model", 128, "model width")
      .add<I>("model.n_layer", 4, "number of blocks (Mamba-2 unless model.pattern says otherwise)")
      .add<I>("model.d_state", m.d_state, "SSM state size N")
      .add<I>("model.d_conv", m.d_conv, "causal conv1d width")
      .add<I>("model.expand", m.expand, "d_inner = expand * d_model")
      .add<I>("model.headdim", m.headdim, "head dimension P (nheads = d_inner / headdim)")
      .add<I>("model.ngroups", m.ngroups, "B/C groups G (nheads must divide by it)")
      .add<I>("model.chunk_size", m.chunk, "SSD chunk length Q (results do not depend on it)")
      .add<double>("model.dt_min", m.dt_min, "initial dt range, lower end")
      .add<double>("model.dt_max", m.dt_max, "initial dt range, upper end")
      .add<double>("model.dt_init_floor", m.dt_init_floor, "smallest initial dt")
      .add<double>("model.A_init_min", m.A_init_lo, "A_log = log(U[A_init_min, A_init_max])")
      .add<double>("model.A_init_max", m.A_init_hi, "A_log = log(U[A_init_min, A_init_max])")
      .add<double>("model.dt_limit_min", m.dt_limit_lo, "clamp of softplus(dt + dt_bias), lower")
      .add<double>("model.dt_limit_max", std::numeric_limits<double>::infinity(),
                   "clamp of softplus(dt + dt_bias), upper (inf: none)")
      .add<double>("model.norm_eps", m.norm_eps, "RMSNorm epsilon")
      .add<I>("model.mixer_window", 0,
              "M1 and M2 layers: run sequences longer than this many tokens in windows carrying the conv and SSM "
              "states (the backward recomputes each window from its boundary state, right to left), so a layer's "
              "working memory follows the window, not the sequence; same results as one pass. 0: one pass")
      .add<std::string>("model.ssd_algorithm", "auto",
                        "M2 layers and M3 SISO layers: how the SSD is computed: auto (on CUDA fused under "
                        "ssd_precision = bf16, else gemm; on CPU gemm for M2, M3's own scan kernels), portable "
                        "(Kokkos team kernels; M3: its own scan kernels), gemm (batched chunk GEMMs), fused (CUDA: "
                        "the chunk scan's forward and the backward's intra-chunk products in tensor-core kernels, "
                        "bf16 operands; otherwise gemm)")
      .add<std::string>("model.ssd_precision", "fp32",
                        "M2 and M3 SISO layers, CUDA: arithmetic of the SSD's chunk GEMMs: fp32, tf32 or bf16 "
                        "(tensor cores, fp32 accumulation); CPU builds always compute in fp32")
      .add<std::string>("model.pattern", "",
                        "layer pattern, one code per pre-norm residual block, spaced (M2 M2 M3 E) or together "
                        "(M2M2M3E): M1 Mamba-1, M2 Mamba-2, M3 Mamba-3, E MoE feed-forward, D dense SwiGLU "
                        "feed-forward. Empty: n_layer x M2. With a pattern, n_layer may be left out (it is the "
                        "pattern's length)")
      .add<I>("model.dense_d_ff", 0, "D layers: SwiGLU hidden size (0: moe.d_ff, i.e. one expert's size)");
  const Mamba1Config m1;
  d.add<I>("mamba1.d_state", m1.d_state, "M1 layers: SSM state size N (dt ranges, d_conv: [model])")
      .add<I>("mamba1.expand", 0, "M1 layers: d_inner = expand * d_model (0: model.expand)")
      .add<I>("mamba1.dt_rank", m1.dt_rank, "M1 layers: rank of the dt projection (0: ceil(d_model / 16))")
      .add<I>("mamba1.chunk_size", m1.chunk, "M1 layers: scan checkpoint interval (results do not depend on it)");
  const Mamba3Config m3;
  d.add<I>("mamba3.d_state", 0, "M3 layers: state size N (0: model.d_state)")
      .add<I>("mamba3.headdim", 0, "M3 layers: head dimension P (0: model.headdim)")
      .add<I>("mamba3.expand", 0, "M3 layers: d_inner = expand * d_model (0: model.expand)")
      .add<I>("mamba3.ngroups", m3.ngroups, "M3 layers: B/C groups")
      .add<bool>("mamba3.mimo", m3.is_mimo, "M3 layers: multi-input multi-output (MIMO) variant")
      .add<I>("mamba3.mimo_rank", m3.mimo_rank, "M3 layers: MIMO rank R")
      .add<I>("mamba3.chunk_size", m3.chunk_size, "M3 layers: scan chunk length (results do not depend on it)")
      .add<double>("mamba3.rope_fraction", m3.rope_fraction, "M3 layers: fraction of the state dimensions rotated")
      .add<std::string>("mamba3.rope_pairing", "by_variant",
                        "M3 layers: rotary pairs: by_variant (SISO interleaved, MIMO halved) | interleaved | halved")
      .add<bool>("mamba3.outproj_norm", m3.is_outproj_norm, "M3 layers: RMSNorm of y before the gate")
      .add<double>("mamba3.A_floor", m3.A_floor, "M3 layers: floor of the data-dependent decay rate");
  const MoEConfig e;
  d.add<I>("moe.n_experts", e.n_experts, "E layers: routed experts")
      .add<I>("moe.top_k", e.top_k, "E layers: experts per token")
      .add<I>("moe.d_ff", e.d_ff, "E layers: SwiGLU hidden size of each expert")
      .add<std::string>("moe.score_func", "softmax", "E layers: router scores: softmax | sigmoid")
      .add<bool>("moe.renormalize", e.renormalize, "E layers: renormalise the top_k gates to sum to 1")
      .add<double>("moe.temperature", e.temperature, "E layers: router logits are divided by it")
      .add<double>("moe.output_scale", e.output_scale, "E layers: multiplies every gate")
      .add<double>("moe.capacity_factor", e.capacity_factor,
                   "E layers: expert capacity = factor * tokens * top_k / n_experts (0: dropless)")
      .add<double>("moe.jitter", e.jitter, "E layers: multiplicative router-input jitter while training (0: off)")
      .add<double>("moe.aux_loss_coef", e.aux_loss_coef,
                   "E layers: load-balancing loss coefficient (added to the mean token loss)")
      .add<double>("moe.z_loss_coef", e.z_loss_coef, "E layers: router z-loss coefficient")
      .add<double>("moe.bias_update_rate", e.bias_update_rate,
                   "E layers: aux-loss-free expert-bias step per optimizer step (0: off)")
      .add<I>("moe.shared_d_ff", e.shared_d_ff, "E layers: hidden size of an always-on shared expert (0: none)")
      .add<bool>("moe.recompute", e.recompute, "E layers: keep no expert activations, recompute in the backward");
}

LayerStackConfig make_layer_stack_config(const io::Deck& d) {
  const std::string ctx = d.path().empty() ? "[model]" : d.path() + " [model]";
  LayerStackConfig c;
  c.pattern = parse_layer_pattern(d.get<std::string>("model.pattern"), ctx + " pattern");
  c.dense_d_ff = d.get<I>("model.dense_d_ff");
  const I expand = d.get<I>("model.expand");
  Mamba1Config& m1 = c.mamba1;
  m1.d_state = d.get<I>("mamba1.d_state");
  m1.expand = d.get<I>("mamba1.expand") > 0 ? d.get<I>("mamba1.expand") : expand;
  m1.dt_rank = d.get<I>("mamba1.dt_rank");
  m1.chunk = d.get<I>("mamba1.chunk_size");
  m1.window = d.get<I>("model.mixer_window");
  m1.d_conv = d.get<I>("model.d_conv");
  m1.dt_min = d.get<double>("model.dt_min");
  m1.dt_max = d.get<double>("model.dt_max");
  m1.dt_init_floor = d.get<double>("model.dt_init_floor");
  Mamba3Config& m3 = c.mamba3;
  m3.d_state = d.get<I>("mamba3.d_state") > 0 ? d.get<I>("mamba3.d_state") : d.get<I>("model.d_state");
  m3.headdim = d.get<I>("mamba3.headdim") > 0 ? d.get<I>("mamba3.headdim") : d.get<I>("model.headdim");
  m3.expand = d.get<I>("mamba3.expand") > 0 ? d.get<I>("mamba3.expand") : expand;
  m3.ngroups = d.get<I>("mamba3.ngroups");
  m3.is_mimo = d.get<bool>("mamba3.mimo");
  m3.mimo_rank = d.get<I>("mamba3.mimo_rank");
  m3.chunk_size = d.get<I>("mamba3.chunk_size");
  m3.rope_fraction = d.get<double>("mamba3.rope_fraction");
  const std::string pairing = d.get<std::string>("mamba3.rope_pairing");
  require(pairing == "by_variant" || pairing == "interleaved" || pairing == "halved", "[mamba3] rope_pairing", "'",
          pairing, "' is not one of: by_variant interleaved halved");
  m3.rope_pairing = pairing == "interleaved" ? Mamba3Config::Pairing::interleaved
                    : pairing == "halved"    ? Mamba3Config::Pairing::halved
                                             : Mamba3Config::Pairing::by_variant;
  m3.is_outproj_norm = d.get<bool>("mamba3.outproj_norm");
  m3.A_floor = d.get<double>("mamba3.A_floor");
  m3.dt_min = d.get<double>("model.dt_min");
  m3.dt_max = d.get<double>("model.dt_max");
  m3.dt_init_floor = d.get<double>("model.dt_init_floor");
  m3.norm_eps = d.get<double>("model.norm_eps");
  parse_ssd_choice(d, m3.scan_algo, m3.scan_compute);
  MoEConfig& e = c.moe;
  e.n_experts = d.get<I>("moe.n_experts");
  e.top_k = d.get<I>("moe.top_k");
  e.d_ff = d.get<I>("moe.d_ff");
  e.score_func = parse_score_func(d.get<std::string>("moe.score_func"), "[moe] score_func");
  e.renormalize = d.get<bool>("moe.renormalize");
  e.temperature = d.get<double>("moe.temperature");
  e.output_scale = d.get<double>("moe.output_scale");
  e.capacity_factor = d.get<double>("moe.capacity_factor");
  e.jitter = d.get<double>("moe.jitter");
  e.aux_loss_coef = d.get<double>("moe.aux_loss_coef");
  e.z_loss_coef = d.get<double>("moe.z_loss_coef");
  e.bias_update_rate = d.get<double>("moe.bias_update_rate");
  e.shared_d_ff = d.get<I>("moe.shared_d_ff");
  e.recompute = d.get<bool>("moe.recompute");
  return c;
}

std::int64_t make_n_layer(const io::Deck& d, const LayerStackConfig& layers) {
  const I n = d.get<I>("model.n_layer");
  if (layers.pattern.empty()) return n;
  const I np = I(layers.pattern.size());
  require(d.defaulted("model.n_layer") || n == np, "[model] n_layer", "n_layer = ", n, " but the pattern '",
          pattern_string(layers.pattern), "' has ", np, " layers (leave n_layer out, or make them agree)");
  return np;
}

void declare_train_options(io::Deck& d) {
  d.add<I>("train.steps", 1000, "optimizer steps")
      .add<I>("train.batch_size", 8, "sequences (windows) per micro-batch")
      .add<I>("train.grad_accum", 1, "micro-batches per optimizer step")
      .add<double>("train.lr", 2e-3, "peak learning rate")
      .add<double>("train.min_lr", 2e-4, "final learning rate of the cosine schedule")
      .add<I>("train.warmup_steps", 100, "linear warmup steps")
      .add<double>("train.weight_decay", 0.1, "AdamW decoupled weight decay (matrices only)")
      .add<double>("train.beta1", 0.9, "AdamW beta1")
      .add<double>("train.beta2", 0.95, "AdamW beta2")
      .add<double>("train.adam_eps", 1e-8, "AdamW epsilon")
      .add<double>("train.grad_clip", 1.0, "clip the global gradient norm to this (0: off)")
      .add<std::string>("train.recompute", "none", "none | mixer: re-run the mixer internals in the backward")
      .add<I>("train.log_interval", 10, "steps between progress lines")
      .add<I>("train.eval_interval", 0, "steps between held-out evaluations (0: at the end only)")
      .add<I>("train.eval_batch_size", 8, "sequences (windows) per evaluation batch")
      .add<double>("train.time_limit_minutes", 0, "stop (with a checkpoint) after this wall time (0: none)");
  d.add<std::string>("checkpoint.path", "checkpoint.h5", "checkpoint file under output_dir (empty: none)")
      .add<I>("checkpoint.interval", 0, "steps between checkpoints (0: only at the end or on a stop)")
      .add<bool>("checkpoint.keep_all", false, "also keep a copy of every checkpoint as <name>_stepNNNNNNNN.h5")
      .add<std::string>("checkpoint.resume", "", "checkpoint to resume from (relative to the working directory)");
}

void declare_lm_options(io::Deck& d) {
  d.add<I>("model.vocab_size", 16, "vocabulary size (6 DNA tokens: pad A C G T N, padded up for GEMM shapes)")
      .add<bool>("model.tie_embeddings", true, "share the embedding matrix with the LM head");
  declare_backbone_options(d);
  declare_train_options(d);
  d.add<I>("train.seq_len", 1024, "tokens per sequence")
      .add<I>("train.eval_seq_len", 0, "tokens per evaluation window (0: seq_len)");
}

Mamba2Config make_mixer_config(const io::Deck& d) {
  Mamba2Config m;
  m.d_model = d.get<I>("model.d_model");
  m.d_state = d.get<I>("model.d_state");
  m.d_conv = d.get<I>("model.d_conv");
  m.expand = d.get<I>("model.expand");
  m.headdim = d.get<I>("model.headdim");
  m.ngroups = d.get<I>("model.ngroups");
  m.chunk = d.get<I>("model.chunk_size");
  m.dt_min = d.get<double>("model.dt_min");
  m.dt_max = d.get<double>("model.dt_max");
  m.dt_init_floor = d.get<double>("model.dt_init_floor");
  m.A_init_lo = d.get<double>("model.A_init_min");
  m.A_init_hi = d.get<double>("model.A_init_max");
  m.dt_limit_lo = d.get<double>("model.dt_limit_min");
  m.dt_limit_hi = d.get<double>("model.dt_limit_max");
  m.norm_eps = d.get<double>("model.norm_eps");
  m.window = d.get<I>("model.mixer_window");
  const std::string where = d.path().empty() ? "[model]" : d.path() + " [model]";
  parse_ssd_choice(d, m.ssd_algo, m.ssd_compute);
  m.validate(d.path().empty() ? "[model]" : d.path() + " [model]");
  return m;
}

LMConfig make_lm_config(const io::Deck& d) {
  LMConfig c;
  c.vocab_size = d.get<I>("model.vocab_size");
  c.layers = make_layer_stack_config(d);
  c.n_layer = make_n_layer(d, c.layers);
  c.tie_embeddings = d.get<bool>("model.tie_embeddings");
  c.norm_eps = d.get<double>("model.norm_eps");
  c.mixer = make_mixer_config(d);
  c.validate(d.path().empty() ? "[model]" : d.path() + " [model]");
  return c;
}

TrainConfig make_train_config(const io::Deck& d) {
  TrainConfig t;
  t.steps = d.get<I>("train.steps");
  t.grad_accum = d.get<I>("train.grad_accum");
  t.log_interval = d.get<I>("train.log_interval");
  t.eval_interval = d.get<I>("train.eval_interval");
  t.schedule.lr = d.get<double>("train.lr");
  t.schedule.min_lr = d.get<double>("train.min_lr");
  t.schedule.warmup = d.get<I>("train.warmup_steps");
  t.schedule.total = t.steps;
  t.adamw.lr = t.schedule.lr;
  t.adamw.beta1 = d.get<double>("train.beta1");
  t.adamw.beta2 = d.get<double>("train.beta2");
  t.adamw.eps = d.get<double>("train.adam_eps");
  t.adamw.weight_decay = d.get<double>("train.weight_decay");
  t.adamw.grad_clip = d.get<double>("train.grad_clip");
  const std::string rc = d.get<std::string>("train.recompute");
  require(rc == "none" || rc == "mixer", "[train] recompute", "unknown policy '", rc, "'; valid: none mixer");
  t.recompute = rc == "mixer" ? Recompute::mixer : Recompute::none;
  if (const auto* p = auto_plan(d)) t.recompute = p->policy;  // layout = auto chooses it
  t.time_limit_minutes = d.get<double>("train.time_limit_minutes");
  const std::string ck = d.get<std::string>("checkpoint.path");
  t.checkpoint_path = ck.empty() ? "" : output_path(d, ck);
  t.checkpoint_interval = d.get<I>("checkpoint.interval");
  t.keep_all_checkpoints = d.get<bool>("checkpoint.keep_all");
  t.resume = d.get<std::string>("checkpoint.resume");
  t.metrics_path = output_path(d, "metrics.csv");
  t.seed = std::uint64_t(d.get<I>("run.seed"));
  t.grid = make_process_grid(d);
  t.zero1 = d.get<bool>("parallel.zero1");
  t.overlap_grad_reduce = d.get<bool>("parallel.overlap_grad_reduce");
  require(t.steps >= 1, "[train] steps", "must be at least 1");
  require(t.grad_accum >= 1, "[train] grad_accum", "must be at least 1");
  require(t.schedule.lr > 0 && t.schedule.min_lr >= 0, "[train] lr", "lr must be positive and min_lr >= 0");
  require(d.get<I>("train.batch_size") >= 1, "[train] batch_size", "must be at least 1");
  return t;
}

std::string input_path(const io::Deck& deck, const std::string& value) {
  namespace fs = std::filesystem;
  if (value.empty() || fs::path(value).is_absolute() || deck.path().empty()) return value;
  return (fs::path(deck.path()).parent_path() / value).lexically_normal().string();
}

std::string output_path(const io::Deck& deck, const std::string& value) {
  namespace fs = std::filesystem;
  if (fs::path(value).is_absolute()) return value;
  return (fs::path(deck.get<std::string>("run.output_dir")) / value).lexically_normal().string();
}

}  // namespace mm::drivers
