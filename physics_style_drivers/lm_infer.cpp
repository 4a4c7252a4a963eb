// lm_score and lm_generate: inference with a trained genomics_lm checkpoint (causal objective), the model rebuilt
// from the deck stored in the checkpoint; both run on the decode state cache (model/infer.hpp).
//
//   lm_score     per-base log-likelihood of a FASTA region: log2 p and ln p of every base given every base before
//                it in the stream (the region, preceded by up to [score] context bases of the record, read but not
//                scored), read in windows of [score] window tokens with the state carried between windows, so model
//                memory does not grow with the region. TSV rows: position (1-based in the record), base, log2_p,
//                ln_p; a final '#' summary line (bases scored, total bits, bits per base). N bases and a first base
//                without context are listed with empty scores and not counted.
//   lm_generate  samples n_tokens bases after a prompt (a string, or a FASTA region) with temperature, top-k and
//                top-p over the four bases A C G T, num_samples sequences at once, deterministic in [generate] seed;
//                FASTA output.
//
// Regions: "NAME" (the whole record) or "NAME:START-END", 1-based inclusive; NAME is a record name or an accession
// inside one (NC_001416 -> gi|9626243|ref|NC_001416.1|); empty: the first record.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "core/error.hpp"
#include "io/fasta.hpp"
#include "io/tokens.hpp"
#include "lm_options.hpp"
#include "model/infer.hpp"
#include "registry.hpp"

namespace mm::drivers {

using I = std::int64_t;

void declare_lm_score(io::Deck& d) {
  d.add<std::string>("score.checkpoint", "", "trained genomics_lm checkpoint (relative to the working directory)")
      .add<std::string>("score.fasta", "", "FASTA file holding the region, relative to the deck")
      .add<std::string>("score.region", "", "NAME or NAME:START-END (1-based, inclusive); empty: the first record")
      .add<I>("score.context", 0, "bases before the region read as unscored context (clipped at the record start)")
      .add<I>("score.window", 4096, "tokens per prefill; the decode state is carried from window to window")
      .add<I>("score.progress_interval", 1000000, "print progress every this many bases (0: never)")
      .add<std::string>("score.output_tsv", "score.tsv", "per-base scores, under output_dir");
}

void declare_lm_generate(io::Deck& d) {
  d.add<std::string>("generate.checkpoint", "", "trained genomics_lm checkpoint (relative to the working directory)")
      .add<std::string>("generate.prompt", "", "prompt bases (A C G T N); or give prompt_fasta and prompt_region")
      .add<std::string>("generate.prompt_fasta", "", "FASTA file holding the prompt region, relative to the deck")
      .add<std::string>("generate.prompt_region", "", "NAME or NAME:START-END (1-based, inclusive) in prompt_fasta")
      .add<I>("generate.n_tokens", 200, "bases to generate after the prompt")
      .add<I>("generate.num_samples", 1, "sequences generated together (each its own random stream)")
      .add<double>("generate.temperature", 1.0, "softmax temperature (0: greedy)")
      .add<I>("generate.top_k", 0, "keep the k most probable bases (0: all)")
      .add<double>("generate.top_p", 1.0, "nucleus: keep the most probable bases up to this probability mass")
      .add<I>("generate.seed", 1, "sampling seed: the same seed gives the same sequences")
      .add<I>("generate.window", 4096, "prompt tokens per prefill")
      .add<I>("generate.line_width", 60, "FASTA line width")
      .add<std::string>("generate.output_fasta", "generated.fa", "generated sequences, under output_dir");
}

namespace {

// The causal LM of a genomics_lm checkpoint.
std::unique_ptr<MambaLM<float>> load_lm(const std::string& ckpt, const std::string& where) {
  require(!ckpt.empty(), where, "checkpoint is required");
  require(std::filesystem::exists(ckpt), ckpt, "no such checkpoint (train one with genomics_lm first)");
  io::Deck trained;
  const std::string stored = checkpoint_deck(ckpt);
  declare_run(trained);
  find(io::peek_text(stored, "run.driver", "genomics_lm")).declare(trained);
  trained.parse_text(stored, ckpt + " (stored deck)");
  const std::string objective = trained.has("model.objective") ? trained.get<std::string>("model.objective") : "causal";
  require(objective == "causal", ckpt, "model objective '", objective,
          "': scoring and generation need a next-base (causal) language model");
  auto lm = std::make_unique<MambaLM<float>>(make_lm_config(trained));
  load_parameters(lm->params(), ckpt);
  std::printf("model: %s (layers %s, %lld parameters; trained on %s)\n", ckpt.c_str(),
              pattern_string(lm->backbone().pattern()).c_str(), (long long)lm->param_count(),
              trained.has("data.fasta") ? trained.get<std::string>("data.fasta").c_str() : "?");
  return lm;
}

struct Region {
  const io::FastaRecord* rec = nullptr;
  I start = 0, end = 0;  // 0-based, [start, end)
  std::string label() const {
    return rec->name + ":" + std::to_string(start + 1) + "-" + std::to_string(end);
  }
};

bool all_digits(const std::string& s) {
  return !s.empty() && s.size() <= 15 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// "NAME" or "NAME:START-END" (1-based inclusive) -> a region of one of the records; errors name the key and value.
Region parse_region(const std::string& text, const std::vector<io::FastaRecord>& recs, const std::string& key) {
  Region r;
  std::string name = text, range;
  const auto colon = text.rfind(':');
  if (colon != std::string::npos) name = text.substr(0, colon), range = text.substr(colon + 1);
  std::string names;
  for (const auto& x : recs) names += " " + x.name;
  if (text.empty()) {
    r.rec = &recs.front();
  } else {
    for (const auto& x : recs)
      if (x.name == name) r.rec = &x;
    if (!r.rec) {  // an accession inside a name: |NAME| or |NAME.<version> or NAME.<version> at the start
      std::vector<const io::FastaRecord*> hits;
      for (const auto& x : recs) {
        const std::string& n = x.name;
        for (auto p = n.find(name); p != std::string::npos; p = n.find(name, p + 1)) {
          const bool left = p == 0 || n[p - 1] == '|';
          const char after = p + name.size() < n.size() ? n[p + name.size()] : '\0';
          if (left && (after == '\0' || after == '|' || after == '.')) {
            hits.push_back(&x);
            break;
          }
        }
      }
      require(hits.size() == 1, key, "'", text, "': record '", name, "' ",
              hits.empty() ? "is not in the FASTA" : "matches more than one record", " (records:", names, ")");
      r.rec = hits[0];
    }
  }
  const I len = I(r.rec->seq.size());
  if (range.empty()) {
    require(colon == std::string::npos, key, "'", text, "': empty range after ':' (expected NAME:START-END)");
    r.start = 0, r.end = len;
    return r;
  }
  const auto dash = range.find('-');
  const std::string a = dash == std::string::npos ? range : range.substr(0, dash);
  const std::string b = dash == std::string::npos ? "" : range.substr(dash + 1);
  require(all_digits(a) && all_digits(b), key, "'", text, "': range '", range,
          "' is not START-END (1-based positions, inclusive)");
  const I s = std::stoll(a), e = std::stoll(b);
  require(s >= 1 && s <= e && e <= len, key, "'", text, "': ", s, "-", e, " is outside record ", r.rec->name,
          " (1-", len, ") or empty");
  r.start = s - 1, r.end = e;
  return r;
}

}  // namespace

int run_lm_score(const io::Deck& d) {
  const std::string where = d.path() + " [score]";
  const std::string fasta = input_path(d, d.get<std::string>("score.fasta"));
  require(!fasta.empty(), where, "fasta is required");
  const I window = d.get<I>("score.window"), context = d.get<I>("score.context");
  const I progress = d.get<I>("score.progress_interval");
  require(window >= 1, "[score] window", "must be at least 1 (got ", window, ")");
  require(context >= 0, "[score] context", "must be >= 0 (got ", context, ")");
  const auto recs = io::read_fasta(fasta);
  const Region reg = parse_region(d.get<std::string>("score.region"), recs, "[score] region");
  auto lm = load_lm(d.get<std::string>("score.checkpoint"), where);

  const std::string& seq = reg.rec->seq;
  const I s0 = std::max<I>(0, reg.start - context);  // the stream: [s0, end); scored: [start, end)
  std::printf("score: %s (%lld bases; %lld bases of context before it), windows of %lld tokens\n",
              reg.label().c_str(), (long long)(reg.end - reg.start), (long long)(reg.start - s0), (long long)window);
  std::fflush(stdout);

  std::filesystem::create_directories(d.get<std::string>("run.output_dir"));
  const std::string tsv = output_path(d, d.get<std::string>("score.output_tsv"));
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> out(std::fopen((tsv + ".tmp").c_str(), "w"), &std::fclose);
  require(out != nullptr, tsv, "cannot write the output");
  std::fprintf(out.get(), "position\tbase\tlog2_p\tln_p\n");

  StreamingScorer<float> scorer(*lm, window);
  const auto t0 = std::chrono::steady_clock::now();
  double nats = 0;
  I scored = 0, next_report = progress;
  std::vector<double> lp;
  for (I at = s0; at < reg.end; at += window) {
    const I n = std::min(window, reg.end - at);
    const auto tok = tokenize(std::string_view(seq).substr(std::size_t(at), std::size_t(n)));
    scorer.feed(tok.data(), n, lp);
    for (I i = 0; i < n; ++i) {
      const I pos = at + i;
      if (pos < reg.start) continue;
      const std::int32_t t = tok[std::size_t(i)];
      if (std::isnan(lp[std::size_t(i)]) || t < kA || t > kT) {
        std::fprintf(out.get(), "%lld\t%c\t\t\n", (long long)pos + 1, token_to_base(t));
        continue;
      }
      const double l = lp[std::size_t(i)];
      std::fprintf(out.get(), "%lld\t%c\t%.6f\t%.6f\n", (long long)pos + 1, token_to_base(t), l / std::log(2.0), l);
      nats -= l;
      ++scored;
    }
    const I done = at + n - reg.start;
    if (progress > 0 && done >= next_report && at + n < reg.end) {
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("progress: %lld / %lld bases (%.1f%%), %.4f bits/base so far, %.0f bases/s\n", (long long)done,
                  (long long)(reg.end - reg.start), 100.0 * double(done) / double(reg.end - reg.start),
                  scored ? nats / std::log(2.0) / double(scored) : 0.0, double(at + n - s0) / std::max(sec, 1e-9));
      std::fflush(stdout);
      while (next_report <= done) next_report += progress;
    }
  }
  const double bits = nats / std::log(2.0), bpb = scored ? bits / double(scored) : 0.0;
  std::fprintf(out.get(), "# region=%s scored_bases=%lld total_bits=%.6f bits_per_base=%.6f\n", reg.label().c_str(),
               (long long)scored, bits, bpb);
  out.reset();
  std::filesystem::rename(tsv + ".tmp", tsv);
  std::printf("summary: %s: %lld bases scored, total %.4f bits, %.6f bits/base (%lld windows)\n",
              reg.label().c_str(), (long long)scored, bits, bpb, (long long)scorer.windows());
  std::printf("scores: %s\n", tsv.c_str());
  return 0;
}

int run_lm_generate(const io::Deck& d) {
  const std::string where = d.path() + " [generate]";
  SamplingConfig sc;
  sc.temperature = d.get<double>("generate.temperature");
  sc.top_k = d.get<I>("generate.top_k");
  sc.top_p = d.get<double>("generate.top_p");
  sc.validate(where);
  const I n_tokens = d.get<I>("generate.n_tokens"), samples = d.get<I>("generate.num_samples");
  const I window = d.get<I>("generate.window"), width = d.get<I>("generate.line_width");
  require(n_tokens >= 1, "[generate] n_tokens", "must be at least 1 (got ", n_tokens, ")");
  require(samples >= 1, "[generate] num_samples", "must be at least 1 (got ", samples, ")");
  require(window >= 1, "[generate] window", "must be at least 1 (got ", window, ")");
  require(width >= 1, "[generate] line_width", "must be at least 1 (got ", width, ")");

  std::string prompt = d.get<std::string>("generate.prompt"), source = "prompt string";
  const std::string pf = input_path(d, d.get<std::string>("generate.prompt_fasta"));
  require(prompt.empty() != pf.empty(), where, "give exactly one of prompt and prompt_fasta");
  if (!pf.empty()) {
    const auto recs = io::read_fasta(pf);
    const Region reg = parse_region(d.get<std::string>("generate.prompt_region"), recs, "[generate] prompt_region");
    prompt = reg.rec->seq.substr(std::size_t(reg.start), std::size_t(reg.end - reg.start));
    source = reg.label();
  } else {
    for (char& c : prompt) c = char(std::toupper(static_cast<unsigned char>(c)));
    const auto bad = prompt.find_first_not_of("ACGTN");
    require(bad == std::string::npos, "[generate] prompt", "'", prompt.substr(0, 40), "': character '",
            bad == std::string::npos ? ' ' : prompt[bad], "' at ", bad + 1, " is not a base (A C G T N)");
  }
  auto lm = load_lm(d.get<std::string>("generate.checkpoint"), where);
  const std::uint64_t seed = std::uint64_t(d.get<I>("generate.seed"));
  std::printf("generate: %lld x %lld bases after a %zu-base prompt (%s), temperature %g, top_k %lld, top_p %g, "
              "seed %llu\n",
              (long long)samples, (long long)n_tokens, prompt.size(), source.c_str(), sc.temperature,
              (long long)sc.top_k, sc.top_p, (unsigned long long)seed);
  std::fflush(stdout);
  const auto t0 = std::chrono::steady_clock::now();
  const auto gen = generate(*lm, tokenize(prompt), samples, n_tokens, sc, seed, window, {kA, kC, kG, kT});
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::filesystem::create_directories(d.get<std::string>("run.output_dir"));
  const std::string fa = output_path(d, d.get<std::string>("generate.output_fasta"));
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> out(std::fopen((fa + ".tmp").c_str(), "w"), &std::fclose);
  require(out != nullptr, fa, "cannot write the output");
  for (I s = 0; s < samples; ++s) {
    std::fprintf(out.get(), ">sample_%lld seed=%llu temperature=%g top_k=%lld top_p=%g prompt=%s prompt_length=%zu\n",
                 (long long)s + 1, (unsigned long long)seed, sc.temperature, (long long)sc.top_k, sc.top_p,
                 source == "prompt string" ? "string" : source.c_str(), prompt.size());
    const auto& g = gen[std::size_t(s)];
    for (I i = 0; i < I(g.size()); ++i) {
      std::fputc(token_to_base(g[std::size_t(i)]), out.get());
      if ((i + 1) % width == 0 || i + 1 == I(g.size())) std::fputc('\n', out.get());
    }
  }
  out.reset();
  std::filesystem::rename(fa + ".tmp", fa);
  std::printf("generated: %lld bases in %.2f s; %s\n", (long long)(samples * n_tokens), sec, fa.c_str());
  return 0;
}

}  // namespace mm::drivers
