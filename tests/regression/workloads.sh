#!/usr/bin/env bash
# End-to-end checks of the workload drivers through the mambamoe executable:
#   1. a genome preprocessed into HDF5 trains exactly as its FASTA does (same seed: identical losses);
#   2. a series preprocessed into HDF5 trains exactly as its CSV does (identical losses and test metrics);
#   3. variant_effect on the lambda genome with a small model: every ALT allele listed, a wrong REF reported (not
#      scored), a symbolic allele reported, names mapped by accession, TSV and VCF written;
#   3c. lm_score streams a region in windows of two sizes to the same total (also a mixed M1 M2 E D pattern, down
#      to windows of 1), names a bad region and refuses a masked-LM checkpoint; lm_generate
#      gives identical output for the same seed;
#   4. a CSV with a NaN stops with an error naming the line, and trains when the deck masks missing values.
# usage: workloads.sh <mambamoe> <source dir> <scratch dir>
set -euo pipefail
exe=$1 src=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
fail() { echo "FAIL: $*"; exit 1; }
losses() { grep '^train,' "$1" | cut -d, -f2-6; }

# 1. genome: FASTA vs HDF5 dataset ------------------------------------------------------------------------------
lambda=$src/inputs/genomics/data/lambda_virus.fa.gz
"$exe" "$src/inputs/datasets/lambda.in" --run.output_dir="$work/pre" > "$work/pre_fasta.log" 2>&1 ||
  { cat "$work/pre_fasta.log"; fail "preprocess fasta"; }
common=(--train.steps=16 --train.log_interval=1 --train.eval_interval=8 --train.warmup_steps=4)
"$exe" "$src/inputs/genomics/lambda.in" "${common[@]}" --run.output_dir="$work/fa" > /dev/null 2>&1 ||
  fail "genomics_lm from FASTA"
"$exe" "$src/inputs/genomics/lambda.in" "${common[@]}" --run.output_dir="$work/h5" --data.fasta= \
  --data.dataset="$work/pre/lambda.h5" > /dev/null 2>&1 || fail "genomics_lm from the HDF5 dataset"
diff <(losses "$work/fa/metrics.csv") <(losses "$work/h5/metrics.csv") > /dev/null ||
  fail "genome: training from the dataset differs from training from the FASTA"
diff <(grep '^eval,' "$work/fa/metrics.csv" | cut -d, -f2-4) <(grep '^eval,' "$work/h5/metrics.csv" | cut -d, -f2-4) \
  > /dev/null || fail "genome: held-out evaluation differs"
echo "ok   genome: FASTA and HDF5 dataset give identical losses over 16 steps"

# 2. series: CSV vs HDF5 dataset --------------------------------------------------------------------------------
"$exe" "$src/inputs/datasets/taylor.in" --run.output_dir="$work/pre" > "$work/pre_csv.log" 2>&1 ||
  { cat "$work/pre_csv.log"; fail "preprocess csv"; }
ts=(--train.steps=30 --train.log_interval=1 --train.eval_interval=10 --train.warmup_steps=5)
"$exe" "$src/inputs/timeseries/taylor.in" "${ts[@]}" --run.output_dir="$work/csv" > /dev/null 2>&1 ||
  fail "timeseries_forecast from CSV"
"$exe" "$src/inputs/timeseries/taylor.in" "${ts[@]}" --run.output_dir="$work/tsh5" --data.csv= \
  --data.dataset="$work/pre/taylor.h5" > /dev/null 2>&1 || fail "timeseries_forecast from the HDF5 dataset"
diff <(losses "$work/csv/metrics.csv") <(losses "$work/tsh5/metrics.csv") > /dev/null ||
  fail "series: training from the dataset differs from training from the CSV"
diff "$work/csv/results.csv" "$work/tsh5/results.csv" > /dev/null || fail "series: test metrics differ"
grep -q "naive: seasonal lag 336" "$work/csv/results.csv" || fail "series: baselines missing from results.csv"
[[ -s $work/csv/forecast.svg && -s $work/csv/forecasts.csv ]] || fail "series: plot or forecasts missing"
echo "ok   series: CSV and HDF5 dataset give identical losses and test metrics"

# 3. variant effect ---------------------------------------------------------------------------------------------
seq=$(zcat "$lambda" | grep -v '^>' | tr -d '\n')
base() { echo "${seq:$(($1 - 1)):$2}"; }  # 1-based position, length
wrong() { case $1 in A) echo C ;; *) echo A ;; esac; }
vcf=$work/lambda.vcf
{
  printf '##fileformat=VCFv4.2\n##contig=<ID=NC_001416,length=48502>\n'
  printf '#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n'
  printf 'NC_001416\t1000\tsnv\t%s\t%s\t.\t.\t.\n' "$(base 1000 1)" "$(wrong "$(base 1000 1)")"
  printf 'NC_001416\t2000\tins\t%s\t%sGATTACA\t.\t.\t.\n' "$(base 2000 1)" "$(base 2000 1)"
  printf 'NC_001416\t3000\tdel\t%s\t%s\t.\t.\t.\n' "$(base 3000 6)" "$(base 3000 1)"
  printf 'NC_001416\t4000\tmulti\t%s\tA,T\t.\t.\t.\n' "$(base 4000 1)"
  printf 'NC_001416\t5000\tbadref\t%s\tG\t.\t.\t.\n' "$(wrong "$(base 5000 1)")"
  printf 'NC_001416\t6000\tsymbolic\t%s\t<DEL>\t.\t.\t.\n' "$(base 6000 1)"
} > "$vcf"
"$exe" "$src/inputs/genomics/saureus_variants.in" --run.output_dir="$work/ve" --variants.vcf="$vcf" \
  --variants.reference="$lambda" --variants.checkpoint="$work/fa/checkpoint.h5" --variants.chrom_map= \
  --variants.window=256 > "$work/ve.log" 2>&1 || { cat "$work/ve.log"; fail "variant_effect"; }
tsv=$work/ve/variant_effect.tsv
[[ $(tail -n +2 "$tsv" | wc -l) -eq 7 ]] || fail "variant_effect: expected 7 ALT alleles in $tsv"
[[ $(awk -F'\t' '$8 == "OK" && $11 != ""' "$tsv" | wc -l) -eq 5 ]] || fail "variant_effect: 5 scored alleles expected"
awk -F'\t' '$3 == "badref" && $8 == "REF_MISMATCH" && $11 == ""' "$tsv" | grep -q . ||
  fail "variant_effect: the wrong REF is not reported as REF_MISMATCH"
awk -F'\t' '$3 == "symbolic" && $8 == "UNSUPPORTED_ALT"' "$tsv" | grep -q . ||
  fail "variant_effect: the symbolic allele is not reported"
grep -q "REF mismatch: NC_001416:5000" "$work/ve.log" || fail "variant_effect: the mismatch is not printed"
grep -q "NC_001416 -> FASTA record gi|9626243|ref|NC_001416.1| (accession)" "$work/ve.log" ||
  fail "variant_effect: the chromosome name was not mapped by accession"
grep -q "MM_DLL" "$work/ve/variant_effect.vcf" || fail "variant_effect: no INFO/MM_DLL in the output VCF"
echo "ok   variant_effect: 7 alleles listed, 5 scored, REF mismatch and symbolic allele reported"

# 3b. the RC-equivariant masked model: both strands give the same score ---------------------------------------
"$exe" "$src/inputs/genomics/lambda_rcps.in" --train.steps=8 --train.eval_interval=0 --run.output_dir="$work/rcps" \
  > /dev/null 2>&1 || fail "genomics_lm with objective rc_equivariant_mlm"
"$exe" "$src/inputs/genomics/saureus_variants.in" --run.output_dir="$work/ve_rcps" --variants.vcf="$vcf" \
  --variants.reference="$lambda" --variants.checkpoint="$work/rcps/checkpoint.h5" --variants.chrom_map= \
  --variants.window=256 > "$work/ve_rcps.log" 2>&1 || { cat "$work/ve_rcps.log"; fail "variant_effect (RCPS)"; }
grep -q "masked marginals" "$work/ve_rcps.log" || fail "variant_effect did not score the RCPS model by masked marginals"
awk -F'\t' 'NR > 1 && $8 == "OK" { d = $12 - $13; if (d < 0) d = -d; if (d > m) m = d; n++ }
             END { exit !(n == 5 && m < 1e-4) }' "$work/ve_rcps/variant_effect.tsv" ||
  fail "RCPS scores differ between strands"
echo "ok   RC-equivariant model: forward- and reverse-strand variant scores agree"

# 3c. streaming scoring and seeded generation with the lambda checkpoint ------------------------------------------
sc=(--score.checkpoint="$work/fa/checkpoint.h5" --score.fasta="$lambda" --score.context=100
    --score.progress_interval=500)
for w in 1400 97; do
  "$exe" "$src/inputs/genomics/lambda_score.in" "${sc[@]}" --score.region=NC_001416:1001-2300 --score.window=$w --run.output_dir="$work/score_$w" \
    > "$work/score_$w.log" 2>&1 || { cat "$work/score_$w.log"; fail "lm_score (window $w)"; }
done
tsv=$work/score_97/score.tsv
[[ $(grep -vc '^#' "$tsv") -eq 1301 ]] || fail "lm_score: expected a header and 1300 rows in $tsv"
awk -F'\t' 'NR == 2 && $1 == 1001 && $3 != "" { ok = 1 } END { exit !ok }' "$tsv" ||
  fail "lm_score: the region's first base (with context) is not scored at position 1001"
grep -q "^progress: " "$work/score_97.log" || fail "lm_score: no progress output"
total() { sed -n 's/.*total_bits=\([0-9.]*\).*/\1/p' "$1/score.tsv"; }
a=$(total "$work/score_1400") b=$(total "$work/score_97")
awk -v a="$a" -v b="$b" 'BEGIN { d = (a - b) / a; if (d < 0) d = -d; exit !(a > 0 && d < 1e-5) }' ||
  fail "lm_score: windows of 1400 and 97 give different totals ($a vs $b bits)"
paste <(grep -v '^#' "$work/score_1400/score.tsv" | cut -f4) <(grep -v '^#' "$tsv" | cut -f4) |
  awk -F'\t' 'NR > 1 { d = $1 - $2; if (d < 0) d = -d; if (d > m) m = d } END { exit !(m < 1e-4) }' ||
  fail "lm_score: per-base scores differ between windows"
if out=$("$exe" "$src/inputs/genomics/lambda_score.in" "${sc[@]}" --score.region=NC_001416:48000-49000 \
         --run.output_dir="$work/score_bad" 2>&1); then
  fail "lm_score accepted a region beyond the record"
fi
[[ $out == *"NC_001416:48000-49000"* && $out == *"outside record"* && $out == *"48502"* ]] ||
  fail "the bad-region error does not name the value and the record length: $out"
if out=$("$exe" "$src/inputs/genomics/lambda_score.in" "${sc[@]}" --score.region=NC_001416:10-x \
         --run.output_dir="$work/score_bad" 2>&1); then
  fail "lm_score accepted a malformed region"
fi
[[ $out == *"NC_001416:10-x"* && $out == *"START-END"* ]] || fail "the malformed-region error is unclear: $out"
echo "ok   lm_score: windows of 1400 and 97 give the same total ($a vs $b bits); bad regions name the value"
# a mixed pattern (Mamba-1, Mamba-2, MoE, dense layers): pure steps (window 1) and windows of 300 agree
"$exe" "$src/inputs/genomics/lambda.in" "--model.pattern=M1 M2 E D" --model.n_layer=4 --train.steps=4 \
  --train.eval_interval=0 --train.warmup_steps=1 --run.output_dir="$work/mixed" > "$work/mixed.log" 2>&1 ||
  { cat "$work/mixed.log"; fail "genomics_lm with pattern M1 M2 E D"; }
for w in 1 300; do
  "$exe" "$src/inputs/genomics/lambda_score.in" --score.checkpoint="$work/mixed/checkpoint.h5" \
    --score.fasta="$lambda" --score.region=NC_001416:1001-1400 --score.window=$w \
    --run.output_dir="$work/mixed_score_$w" > "$work/mixed_score_$w.log" 2>&1 ||
    { cat "$work/mixed_score_$w.log"; fail "lm_score, mixed pattern (window $w)"; }
done
a=$(total "$work/mixed_score_1") b=$(total "$work/mixed_score_300")
awk -v a="$a" -v b="$b" 'BEGIN { d = (a - b) / a; if (d < 0) d = -d; exit !(a > 0 && d < 1e-5) }' ||
  fail "lm_score, mixed pattern: windows of 1 and 300 give different totals ($a vs $b bits)"
echo "ok   lm_score, pattern M1 M2 E D: windows of 1 and 300 give the same total ($a vs $b bits)"
# a masked-LM checkpoint cannot score or generate
if out=$("$exe" "$src/inputs/genomics/lambda_score.in" --score.checkpoint="$work/rcps/checkpoint.h5" \
         --score.fasta="$lambda" --run.output_dir="$work/score_bad" 2>&1); then
  fail "lm_score accepted a masked-LM checkpoint"
fi
[[ $out == *"rc_equivariant_mlm"* && $out == *"causal"* ]] || fail "the masked-LM error is unclear: $out"
gen=(--generate.checkpoint="$work/fa/checkpoint.h5" --generate.prompt_fasta="$lambda" --generate.n_tokens=120
     --generate.num_samples=2 --generate.top_k=3 --generate.top_p=0.9 --generate.temperature=1.2)
for r in a b; do
  "$exe" "$src/inputs/genomics/lambda_generate.in" "${gen[@]}" --generate.seed=5 --run.output_dir="$work/gen_$r" \
    > "$work/gen_$r.log" 2>&1 || { cat "$work/gen_$r.log"; fail "lm_generate"; }
done
"$exe" "$src/inputs/genomics/lambda_generate.in" "${gen[@]}" --generate.seed=6 --generate.window=7 \
  --run.output_dir="$work/gen_c" > "$work/gen_c.log" 2>&1 || { cat "$work/gen_c.log"; fail "lm_generate (seed 6)"; }
cmp -s "$work/gen_a/generated.fa" "$work/gen_b/generated.fa" || fail "lm_generate: the same seed gave different output"
[[ $(grep -c '^>' "$work/gen_a/generated.fa") -eq 2 ]] || fail "lm_generate: expected 2 records"
[[ $(grep -v '^>' "$work/gen_a/generated.fa" | tr -d '\n' | tr -d 'ACGT' | wc -c) -eq 0 &&
   $(grep -v '^>' "$work/gen_a/generated.fa" | tr -d '\n' | wc -c) -eq 240 ]] ||
  fail "lm_generate: expected 2 x 120 bases of A C G T"
! cmp -s "$work/gen_a/generated.fa" "$work/gen_c/generated.fa" || fail "lm_generate: another seed gave the same output"
echo "ok   lm_generate: the same seed gives identical FASTA, another seed another"

# 4. a NaN in a CSV ---------------------------------------------------------------------------------------------
csv=$work/nan.csv
awk 'BEGIN { print "t,load"; for (i = 0; i < 1500; i++) printf "%d,%s\n", i, (i == 700 ? "NaN" : sprintf("%.4f", sin(i / 7.6) + i / 3000)) }' > "$csv"
if out=$("$exe" "$src/inputs/timeseries/taylor.in" --run.output_dir="$work/nan" --data.csv="$csv" \
         --data.timestamp_column=t --train.steps=2 2>&1); then
  fail "a NaN in the CSV was accepted"
fi
[[ $out == *"$csv:702"* && $out == *"missing value"* ]] || fail "the NaN error does not name the line: $out"
"$exe" "$src/inputs/timeseries/taylor.in" --run.output_dir="$work/nan" --data.csv="$csv" --data.timestamp_column=t \
  --data.mask_missing=true --train.steps=3 --train.eval_interval=0 > "$work/nan.log" 2>&1 ||
  { cat "$work/nan.log"; fail "training with a masked NaN"; }
echo "ok   CSV: a NaN names its line ($csv:702) and trains when masked"
echo "all workload checks passed"
