// variant_effect: score every variant of a VCF against a reference FASTA with a trained DNA language model.
//
// For each ALT allele: the reference window (window bases centred on the variant) and a window of the same length
// with the allele substituted (the same left flank, the ALT allele, then the sequence after the REF allele); the
// score is log p(alt window) - log p(ref window) in nats, each the sum of next-base log-likelihoods over its
// window. With strand = both the score is averaged with the same difference on the reverse-complement strand. A
// checkpoint of the RC-equivariant masked model ([model] objective = rc_equivariant_mlm) is scored by masked
// marginals instead: log p(ALT | window, allele masked) - log p(REF | window, allele masked). The REF allele is
// checked against the FASTA: a variant whose REF disagrees is reported (REF_MISMATCH) and not scored. VCF names are
// mapped to FASTA record names explicitly ([variants] chrom_map) or by matching an accession inside the FASTA
// name (NC_007795 -> gi|88193823|ref|NC_007795.1|).
#include <htslib/hts.h>
#include <htslib/vcf.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>

#include "core/error.hpp"
#include "io/fasta.hpp"
#include "io/tokens.hpp"
#include "lm_options.hpp"
#include "model/rcps_lm.hpp"
#include "registry.hpp"

namespace mm::drivers {

using I = std::int64_t;

void declare_variant_effect(io::Deck& d) {
  d.add<std::string>("variants.vcf", "", "VCF or BCF file (plain or bgzip/gzip), relative to the deck")
      .add<std::string>("variants.reference", "", "reference FASTA the VCF was called against, relative to the deck")
      .add<std::string>("variants.checkpoint", "", "trained genomics_lm checkpoint (relative to the working directory); "
                                                   "the model is rebuilt from the deck stored in it")
      .add<std::string>("variants.chrom_map", "", "VCF=FASTA record-name pairs, separated by spaces "
                                                  "(unlisted names: exact match, then accession match)")
      .add<I>("variants.window", 1024, "bases of context centred on each variant")
      .add<std::string>("variants.strand", "both", "forward | both: average the score over both strands")
      .add<I>("variants.batch_size", 16, "windows per forward pass")
      .add<std::string>("variants.output_tsv", "variant_effect.tsv", "scores, one row per ALT allele, under output_dir")
      .add<std::string>("variants.output_vcf", "", "if set: the input VCF with INFO/MM_DLL added, under output_dir");
}

namespace {

struct HtsFileCloser {
  void operator()(htsFile* f) const noexcept { hts_close(f); }
};
struct HdrFree {
  void operator()(bcf_hdr_t* h) const noexcept { bcf_hdr_destroy(h); }
};
struct RecFree {
  void operator()(bcf1_t* r) const noexcept { bcf_destroy(r); }
};

std::string upper(std::string s) {
  for (char& c : s) c = char(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::string revcomp(const std::string& s) {
  std::string r(s.rbegin(), s.rend());
  for (char& c : r) c = c == 'A' ? 'T' : c == 'T' ? 'A' : c == 'C' ? 'G' : c == 'G' ? 'C' : 'N';
  return r;
}

// FASTA record for a VCF chromosome name: the explicit map, then an exact match, then the one record whose name
// holds the name as an accession ("|NAME|", "|NAME.<version>", "NAME.<version>").
class ChromResolver {
 public:
  ChromResolver(const std::vector<io::FastaRecord>& recs, const std::string& map_text, const std::string& where)
      : recs_(recs), where_(where) {
    std::istringstream is(map_text);
    std::string pair;
    while (is >> pair) {
      const auto eq = pair.find('=');
      require(eq != std::string::npos && eq > 0 && eq + 1 < pair.size(), where, "chrom_map entry '", pair,
              "' is not VCF_NAME=FASTA_NAME");
      explicit_[pair.substr(0, eq)] = pair.substr(eq + 1);
    }
    for (std::size_t i = 0; i < recs.size(); ++i) by_name_[recs[i].name] = i;
  }

  const io::FastaRecord& resolve(const std::string& chrom) {
    if (auto it = cache_.find(chrom); it != cache_.end()) return recs_[it->second];
    std::size_t idx = recs_.size();
    std::string how;
    if (auto e = explicit_.find(chrom); e != explicit_.end()) {
      auto it = by_name_.find(e->second);
      require(it != by_name_.end(), where_, "chrom_map maps ", chrom, " to '", e->second,
              "', which is not a record of the reference FASTA");
      idx = it->second;
      how = "chrom_map";
    } else if (auto it = by_name_.find(chrom); it != by_name_.end()) {
      idx = it->second;
      how = "same name";
    } else {
      std::vector<std::size_t> hits;
      for (std::size_t i = 0; i < recs_.size(); ++i) {
        const std::string& n = recs_[i].name;
        for (std::size_t p = n.find(chrom); p != std::string::npos; p = n.find(chrom, p + 1)) {
          const bool left = p == 0 || n[p - 1] == '|';
          const char after = p + chrom.size() < n.size() ? n[p + chrom.size()] : '\0';
          if (left && (after == '\0' || after == '|' || after == '.')) {
            hits.push_back(i);
            break;
          }
        }
      }
      std::string names;
      for (const auto& r : recs_) names += " " + r.name;
      require(hits.size() == 1, where_, "VCF chromosome '", chrom, "' ",
              hits.empty() ? "matches no" : "matches more than one", " FASTA record (records:", names,
              "); map it with [variants] chrom_map = ", chrom, "=<record>");
      idx = hits[0];
      how = "accession";
    }
    std::printf("chromosome %s -> FASTA record %s (%s)\n", chrom.c_str(), recs_[idx].name.c_str(), how.c_str());
    cache_[chrom] = idx;
    return recs_[idx];
  }

 private:
  const std::vector<io::FastaRecord>& recs_;
  std::string where_;
  std::map<std::string, std::string> explicit_;
  std::map<std::string, std::size_t> by_name_;
  std::map<std::string, std::size_t> cache_;
};

struct Job {
  std::string chrom, id, ref, alt, record, type, status = "OK", note;
  I pos = 0;  // 0-based
  std::string ref_win, alt_win;
  I m0 = 0, ref_m1 = 0, alt_m1 = 0;  // the allele's positions in the windows: [m0, ref_m1) and [m0, alt_m1)
  double ll_ref = 0, ll_alt = 0, ll_ref_rc = 0, ll_alt_rc = 0;
};

// A window to score and, for a masked model, the positions [m0, m1) whose bases are masked and scored.
struct Win {
  std::string seq;
  I m0 = 0, m1 = 0;
};

// Log-likelihood of each window (nats). Causal model: the sum of log p(base_t | bases before t) over every scored
// base after the first. Masked model: the sum of log p(base_t | window with [m0, m1) masked) over t in [m0, m1) (the
// masked marginal).
template <class Model>
std::vector<double> log_likelihoods(Model& model, const std::vector<Win>& wins, I batch) {
  constexpr bool masked = std::is_same_v<Model, RCPSMaskedLM<float>>;
  std::vector<double> out;
  for (std::size_t w0 = 0; w0 < wins.size(); w0 += std::size_t(batch)) {
    const std::size_t w1 = std::min(wins.size(), w0 + std::size_t(batch));
    I L = 0;
    for (std::size_t w = w0; w < w1; ++w) L = std::max<I>(L, I(wins[w].seq.size()));
    io::HostBatch hb(I(w1 - w0), L);
    for (std::size_t w = w0; w < w1; ++w) {
      const auto tok = tokenize(wins[w].seq);
      const I r = I(w - w0), n = I(tok.size());
      for (I t = 0; t < L; ++t) {
        const std::size_t o = std::size_t(r * L + t);
        const std::int32_t cur = t < n ? tok[std::size_t(t)] : kPad;
        hb.tokens[o] = cur;
        hb.seq_idx[o] = t < n ? 0 : -1;
        if constexpr (masked) {
          const bool in_allele = t >= wins[w].m0 && t < wins[w].m1;
          hb.tokens[o] = in_allele ? kMaskToken : cur;
          hb.targets[o] = in_allele && cur >= kA && cur <= kT ? cur : -1;
        } else {
          const std::int32_t next = t + 1 < n ? tok[std::size_t(t + 1)] : kPad;
          hb.targets[o] = (next >= kA && next <= kT) ? next : -1;
        }
      }
    }
    const auto nats = model.token_nats(to_device(hb));
    for (I r = 0; r < hb.batch; ++r) {
      double s = 0;
      for (I t = 0; t < L; ++t) s += nats[std::size_t(r * L + t)];
      out.push_back(-s);
    }
  }
  return out;
}

// Score every scorable job: (ref, alt) windows on the forward strand, and on the reverse strand if asked.
template <class Model>
void score(Model& model, std::vector<Job>& jobs, bool both, I batch) {
  std::vector<Win> wins;
  for (const Job& j : jobs)
    if (j.status == "OK") {
      wins.push_back({j.ref_win, j.m0, j.ref_m1});
      wins.push_back({j.alt_win, j.m0, j.alt_m1});
    }
  const std::size_t n_fwd = wins.size();
  if (both)
    for (std::size_t i = 0; i < n_fwd; ++i) {
      const Win& w = wins[i];
      const I n = I(w.seq.size());
      wins.push_back({revcomp(w.seq), n - w.m1, n - w.m0});
    }
  const auto ll = log_likelihoods(model, wins, batch);
  std::size_t k = 0;
  for (Job& j : jobs)
    if (j.status == "OK") {
      j.ll_ref = ll[k];
      j.ll_alt = ll[k + 1];
      if (both) {
        j.ll_ref_rc = ll[n_fwd + k];
        j.ll_alt_rc = ll[n_fwd + k + 1];
      }
      k += 2;
    }
}

}  // namespace

int run_variant_effect(const io::Deck& d) {
  const std::string vcf = input_path(d, d.get<std::string>("variants.vcf"));
  const std::string ref_path = input_path(d, d.get<std::string>("variants.reference"));
  const std::string ckpt = d.get<std::string>("variants.checkpoint");
  const std::string where = d.path() + " [variants]";
  require(!vcf.empty() && !ref_path.empty() && !ckpt.empty(), where, "vcf, reference and checkpoint are required");
  const I window = d.get<I>("variants.window"), batch = d.get<I>("variants.batch_size");
  const std::string strand = d.get<std::string>("variants.strand");
  require(strand == "forward" || strand == "both", where, "strand '", strand, "' is not one of: forward both");
  require(window >= 2 && batch >= 1, where, "window must be >= 2 and batch_size >= 1");

  // The model, rebuilt from the deck stored in its checkpoint.
  require(std::filesystem::exists(ckpt), ckpt, "no such checkpoint (train one with genomics_lm first)");
  io::Deck trained;
  const std::string stored = checkpoint_deck(ckpt);
  declare_run(trained);
  find(io::peek_text(stored, "run.driver", "genomics_lm")).declare(trained);
  trained.parse_text(stored, ckpt + " (stored deck)");
  const std::string objective = trained.has("model.objective") ? trained.get<std::string>("model.objective") : "causal";
  require(objective == "causal" || objective == "rc_equivariant_mlm", ckpt, "unknown model objective '", objective,
          "'");
  std::unique_ptr<MambaLM<float>> causal;
  std::unique_ptr<RCPSMaskedLM<float>> rcps;
  if (objective == "causal") {
    causal = std::make_unique<MambaLM<float>>(make_lm_config(trained));
    load_parameters(causal->params(), ckpt);
  } else {
    rcps = std::make_unique<RCPSMaskedLM<float>>(make_lm_config(trained));
    load_parameters(rcps->params(), ckpt);
  }
  std::printf("model: %s (%s, %lld parameters; trained on %s)\n", ckpt.c_str(),
              causal ? "next-base LM: windows scored by their log-likelihood"
                     : "RC-equivariant masked LM: alleles scored by their masked marginals",
              (long long)(causal ? causal->params().count() : rcps->params().count()),
              trained.has("data.fasta") ? trained.get<std::string>("data.fasta").c_str() : "?");

  const auto recs = io::read_fasta(ref_path);
  ChromResolver chroms(recs, d.get<std::string>("variants.chrom_map"), where);

  // Read every record and ALT allele.
  std::unique_ptr<htsFile, HtsFileCloser> fp(hts_open(vcf.c_str(), "r"));
  require(fp != nullptr, vcf, "cannot open the VCF file");
  std::unique_ptr<bcf_hdr_t, HdrFree> hdr(bcf_hdr_read(fp.get()));
  require(hdr != nullptr, vcf, "cannot read the VCF header (is it a VCF file?)");
  std::unique_ptr<bcf1_t, RecFree> rec(bcf_init());
  std::vector<Job> jobs;
  I n_records = 0;
  int rc = 0;
  while ((rc = bcf_read(fp.get(), hdr.get(), rec.get())) == 0) {
    ++n_records;
    bcf_unpack(rec.get(), BCF_UN_STR);
    const std::string chrom = bcf_hdr_id2name(hdr.get(), rec->rid);
    const io::FastaRecord& fr = chroms.resolve(chrom);
    const std::string ref = upper(rec->d.allele[0]);
    const I pos = rec->pos;
    std::string found;
    const bool in_range = pos >= 0 && pos + I(ref.size()) <= I(fr.seq.size());
    if (in_range) found = fr.seq.substr(std::size_t(pos), ref.size());
    for (int a = 1; a < rec->n_allele; ++a) {
      Job j;
      j.chrom = chrom;
      j.id = rec->d.id ? rec->d.id : ".";
      j.ref = ref;
      j.alt = upper(rec->d.allele[a]);
      j.record = fr.name;
      j.pos = pos;
      j.type = j.ref.size() == j.alt.size() ? (j.ref.size() == 1 ? "SNV" : "MNV")
                                            : (j.alt.size() > j.ref.size() ? "INS" : "DEL");
      if (!in_range) {
        j.status = "OUT_OF_RANGE";
        j.note = "position beyond the end of " + fr.name;
      } else if (found != ref) {
        j.status = "REF_MISMATCH";
        j.note = "FASTA has " + found;
      } else if (j.alt.find_first_not_of("ACGTN") != std::string::npos || j.alt.empty()) {
        j.status = "UNSUPPORTED_ALT";
        j.type = "OTHER";
        j.note = "symbolic or non-nucleotide allele";
      } else {
        // Two windows of the same length: the reference sequence from `left`, and the same left flank followed by
        // the ALT allele and the sequence after the REF allele. A deletion longer than the right half-window is
        // thus scored by its junction, not by the likelihood of every deleted base.
        const I n = I(fr.seq.size());
        const I left = std::max<I>(0, std::min<I>(pos - window / 2, n - window));
        const I len = std::min<I>(window, n - left);
        j.ref_win = fr.seq.substr(std::size_t(left), std::size_t(len));
        j.alt_win = (fr.seq.substr(std::size_t(left), std::size_t(pos - left)) + j.alt +
                     fr.seq.substr(std::size_t(pos + I(ref.size()))))
                        .substr(0, std::size_t(len));
        j.m0 = pos - left;
        j.ref_m1 = std::min<I>(len, j.m0 + I(ref.size()));
        j.alt_m1 = std::min<I>(len, j.m0 + I(j.alt.size()));
      }
      jobs.push_back(std::move(j));
    }
  }
  require(rc == -1, vcf, "read error after record ", n_records, " (htslib status ", rc, ")");

  // Score in batches of windows.
  const bool both = strand == "both";
  if (causal) score(*causal, jobs, both, batch);
  else score(*rcps, jobs, both, batch);

  // Outputs.
  std::filesystem::create_directories(d.get<std::string>("run.output_dir"));
  const std::string tsv = output_path(d, d.get<std::string>("variants.output_tsv"));
  std::ofstream out(tsv + ".tmp");
  require(bool(out), tsv, "cannot write the output");
  out << "chrom\tpos\tid\tref\talt\tfasta_record\ttype\tstatus\tll_ref\tll_alt\tdelta_ll"
      << (both ? "\tdelta_ll_forward\tdelta_ll_revcomp" : "") << "\tnote\n";
  out.precision(8);
  I scored = 0, mismatched = 0, unsupported = 0;
  std::vector<std::pair<double, const Job*>> ranked;
  for (const Job& j : jobs) {
    out << j.chrom << "\t" << j.pos + 1 << "\t" << j.id << "\t" << j.ref << "\t" << j.alt << "\t" << j.record << "\t"
        << j.type << "\t" << j.status;
    if (j.status == "OK") {
      const double fwd = j.ll_alt - j.ll_ref, rcd = j.ll_alt_rc - j.ll_ref_rc, score = both ? 0.5 * (fwd + rcd) : fwd;
      out << "\t" << (both ? 0.5 * (j.ll_ref + j.ll_ref_rc) : j.ll_ref) << "\t"
          << (both ? 0.5 * (j.ll_alt + j.ll_alt_rc) : j.ll_alt) << "\t" << score;
      if (both) out << "\t" << fwd << "\t" << rcd;
      ranked.push_back({score, &j});
      ++scored;
    } else {
      out << "\t\t\t" << (both ? "\t\t" : "");
      (j.status == "REF_MISMATCH" ? mismatched : unsupported)++;
    }
    out << "\t" << j.note << "\n";
  }
  out.close();
  std::filesystem::rename(tsv + ".tmp", tsv);

  const std::string out_vcf = d.get<std::string>("variants.output_vcf");
  if (!out_vcf.empty()) {
    const std::string path = output_path(d, out_vcf);
    std::unique_ptr<htsFile, HtsFileCloser> in2(hts_open(vcf.c_str(), "r"));
    std::unique_ptr<bcf_hdr_t, HdrFree> h2(bcf_hdr_read(in2.get()));
    bcf_hdr_append(h2.get(), "##INFO=<ID=MM_DLL,Number=A,Type=Float,Description=\"mambamoe: log p(alt window) - "
                             "log p(ref window), nats; missing when not scored\">");
    require(bcf_hdr_sync(h2.get()) == 0, path, "cannot extend the VCF header");
    std::unique_ptr<htsFile, HtsFileCloser> wf(hts_open((path + ".tmp").c_str(), path.size() > 3 &&
                                                         path.compare(path.size() - 3, 3, ".gz") == 0 ? "wz" : "w"));
    require(wf != nullptr, path, "cannot write the VCF");
    require(bcf_hdr_write(wf.get(), h2.get()) == 0, path, "cannot write the VCF header");
    std::size_t ji = 0;
    while (bcf_read(in2.get(), h2.get(), rec.get()) == 0) {
      bcf_unpack(rec.get(), BCF_UN_ALL);
      std::vector<float> v(std::size_t(rec->n_allele - 1));
      for (float& x : v) {
        const Job& j = jobs[ji++];
        if (j.status == "OK") {
          const double fwd = j.ll_alt - j.ll_ref, rcd = j.ll_alt_rc - j.ll_ref_rc;
          x = float(both ? 0.5 * (fwd + rcd) : fwd);
        } else {
          bcf_float_set_missing(x);
        }
      }
      bcf_update_info_float(h2.get(), rec.get(), "MM_DLL", v.data(), int(v.size()));
      require(bcf_write(wf.get(), h2.get(), rec.get()) == 0, path, "cannot write a VCF record");
    }
    wf.reset();
    std::filesystem::rename(path + ".tmp", path);
    std::printf("vcf: %s (INFO/MM_DLL)\n", path.c_str());
  }

  std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::printf("variants: %lld records, %zu ALT alleles: %lld scored, %lld REF mismatches, %lld not scorable\n",
              (long long)n_records, jobs.size(), (long long)scored, (long long)mismatched, (long long)unsupported);
  for (const Job& j : jobs)
    if (j.status == "REF_MISMATCH")
      std::printf("  REF mismatch: %s:%lld %s>%s (%s)\n", j.chrom.c_str(), (long long)j.pos + 1,
                  j.ref.substr(0, 40).c_str(), j.alt.substr(0, 40).c_str(), j.note.substr(0, 60).c_str());
  if (!ranked.empty()) {
    std::printf("most negative scores (alt least likely under the model):\n");
    auto brief = [](const std::string& a) {  // alleles of structural variants run to tens of kilobases
      return a.size() <= 12 ? a : a.substr(0, 8) + "...(" + std::to_string(a.size()) + " bp)";
    };
    for (std::size_t i = 0; i < std::min<std::size_t>(5, ranked.size()); ++i) {
      const Job& j = *ranked[i].second;
      std::printf("  %s:%lld %s>%s %s  %.4f nats\n", j.chrom.c_str(), (long long)j.pos + 1, brief(j.ref).c_str(),
                  brief(j.alt).c_str(), j.type.c_str(), ranked[i].first);
    }
  }
  std::printf("scores: %s\n", tsv.c_str());
  return 0;
}

}  // namespace mm::drivers
