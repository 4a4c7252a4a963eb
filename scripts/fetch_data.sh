#!/usr/bin/env bash
# Fetches the real genomes that are too large to ship in the repository (inputs/genomics/data holds only the lambda
# phage) into data/ at the repository root, which git ignores. Debian ships them as example data of its packages,
# so any machine that reaches a Debian mirror can get them with `apt-get download` (no root, nothing installed).
# Each file is checked by content (record count and sequence length, or variant count) rather than by checksum, so
# that a rebuilt package with re-compressed but identical data still passes; files already present and correct are
# skipped, and nothing lands in data/ before it has been verified.
#
# usage: scripts/fetch_data.sh [ecoli|saureus|all]    (default: all)
set -euo pipefail

readonly RAGOUT_ECOLI=./usr/share/doc/ragout/examples/E.Coli/references
readonly SIBELIA_SAUREUS=./usr/share/doc/sibelia/examples/C-Sibelia/Staphylococcus_aureus

# name in data/ | Debian package | path inside the .deb | kind | expected records | expected bases (FASTA only)
readonly ECOLI=(
  "ecoli_mg1655.fa.gz|ragout-examples|$RAGOUT_ECOLI/MG1655-K12.fasta.gz|fasta|1|4639675"
)
readonly SAUREUS=(
  "saureus_nctc8325.fa.gz|sibelia-examples|$SIBELIA_SAUREUS/NCTC8325.fasta.gz|fasta|1|2821361"
  "saureus_rn4220_vs_nctc8325.vcf.gz|sibelia-examples|$SIBELIA_SAUREUS/variant.vcf.gz|vcf|109|"
)

die() {
  echo "fetch_data.sh: error: $*" >&2
  exit 1
}

usage() {
  echo "usage: $0 [ecoli|saureus|all]" >&2
  exit 2
}

[[ $# -le 1 ]] || usage
case "${1:-all}" in
  ecoli) entries=("${ECOLI[@]}") ;;
  saureus) entries=("${SAUREUS[@]}") ;;
  all) entries=("${ECOLI[@]}" "${SAUREUS[@]}") ;;
  -h | --help) usage ;;
  *) usage ;;
esac

for tool in apt-get dpkg-deb tar gzip awk md5sum; do
  command -v "$tool" > /dev/null || die "'$tool' not found: this script needs a Debian-based machine (apt-get download)"
done

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
data_dir=$repo_root/data
mkdir -p "$data_dir"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/mambamoe_fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# Prints "records bases" of a gzip'd FASTA; whitespace and CR inside sequence lines do not count as bases.
fasta_stats() {
  gzip -dc "$1" | awk '/^>/ { r++; next } { gsub(/[ \t\r]/, ""); b += length($0) } END { print r + 0, b + 0 }'
}

# verify FILE KIND RECORDS BASES: succeeds when FILE is intact gzip with the expected content.
verify() {
  local file=$1 kind=$2 records=$3 bases=$4 got
  gzip -t "$file" 2> /dev/null || return 1
  if [[ $kind == fasta ]]; then
    got=$(fasta_stats "$file")
    [[ $got == "$records $bases" ]] || { echo "  $file: expected $records record(s), $bases bp; got $got" >&2; return 1; }
  else
    got=$(gzip -dc "$file" | grep -vc '^#' || true)
    [[ $got == "$records" ]] || { echo "  $file: expected $records variants; got $got" >&2; return 1; }
  fi
}

# Downloads a package once per run and prints the path of its .deb.
deb_of() {
  local pkg=$1 dir=$tmp/$1
  if [[ ! -d $dir ]]; then
    mkdir -p "$dir"
    (cd "$dir" && apt-get download "$pkg" > "$tmp/$pkg.log" 2>&1) || {
      cat "$tmp/$pkg.log" >&2
      rm -rf "$dir"
      die "'apt-get download $pkg' failed: the machine needs a reachable Debian mirror and a current package" \
          "index (run 'apt-get update' as root); or get $pkg's .deb some other way and extract the files by hand"
    }
  fi
  local debs=("$dir"/*.deb)
  [[ -f ${debs[0]} ]] || die "apt-get download $pkg produced no .deb"
  echo "${debs[0]}"
}

for entry in "${entries[@]}"; do
  IFS='|' read -r name pkg member kind records bases <<< "$entry"
  target=$data_dir/$name
  if [[ -f $target ]]; then
    if verify "$target" "$kind" "$records" "$bases"; then
      echo "skipped  data/$name (present and verified)"
      continue
    fi
    echo "refetch  data/$name (present but does not verify)"
  fi
  deb=$(deb_of "$pkg")
  version=$(dpkg-deb -f "$deb" Version)
  dpkg-deb --fsys-tarfile "$deb" | tar -xO "$member" > "$tmp/$name" ||
    die "$member is not in $pkg $version (has the package changed?)"
  verify "$tmp/$name" "$kind" "$records" "$bases" || die "$member from $pkg $version does not have the expected content"
  mv "$tmp/$name" "$target"
  md5=$(md5sum "$target" | cut -d' ' -f1)
  # Provenance next to the data, since data/ itself is not under version control.
  printf 'package=%s\nversion=%s\nmember=%s\nmd5=%s\n' "$pkg" "$version" "$member" "$md5" > "$target.source"
  echo "fetched  data/$name ($(stat -c %s "$target") bytes, md5 $md5) from $pkg $version"
done
