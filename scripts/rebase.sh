#!/usr/bin/env bash
# rebase.sh TO: move the pin to another megatron-core and carry patches/series over (make rebase TO=...).
#   TO = a megatron-core version (0.19.2: PyPI channel) or a Megatron-LM git ref (main, a tag, a
#   commit: git channel). pypi:X / git:X force the reading.
# For a version, the sdist comes from PyPI (pip, hash-checked), and the script looks for the git
# commit whose tree gives the same pristine tree (the core_vX.Y.Z tag, its parents, the release
# branch; needs upstream/ filled); found -> both channels are pinned, else the pin is PyPI-only.
# For a git ref, the pin is git-only (MCORE_VERSION and MCORE_SDIST_SHA256 empty).
# Then, on the new pristine tree, each patch of patches/series in order, fuzz 0, gets one verdict:
#   applies cleanly | applied only with offset or fuzz (refreshed, diff shown) |
#   already in upstream (its reverse applies with -F0: dropped from series, file deleted) | conflicts
# A conflict stops the rebase with exit 3: pin.env and patches/ are left as they were, the work tree
# with the .rej files stays in build/rebase-<target>/ and the next step is printed.
# On success pin.env, patches/ (refreshed, dropped, Base:/Last-Update: updated) and the upstream/
# gitlink (checked out and staged) are rewritten in place; review with git diff / git status.
# The verdict table also goes to build/rebase-<target>.log.
# Environment:
#   DRY_RUN=1          print the table, change nothing (pin, patches/, upstream/ untouched)
#   SHA256=<hex>       expected sha256 of the PyPI sdist (else pip's index-checked download is hashed)
#   GIT=<ref>          pair a PyPI version with this git commit (checked to give the same tree)
#   REBASE_SDIST=FILE  use this local sdist instead of PyPI (offline use, tests)
#   REBASE_DATE=Y-M-D  the Last-Update: date (default: today, UTC)
. "$(dirname "$0")/lib.sh"
need_patch
need_quilt
py=$VENV/bin/python
[ -x "$py" ] || die "no virtual environment at $VENV: run 'make venv' first"
helpers() { "$py" "$ROOT/scripts/rebase_helpers.py" "$@"; }

to=${1:-${TO:-}}
[ -n "$to" ] || die "usage: make rebase TO=<megatron-core version | Megatron-LM git ref> [DRY_RUN=1]"
case "$to" in
  pypi:*) kind=pypi ref=${to#pypi:} ;;
  git:*) kind=git ref=${to#git:} ;;
  *)
    ref=$to
    if [[ $to =~ ^[0-9]+(\.[0-9]+)+((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?$ ]]; then kind=pypi; else kind=git; fi
    ;;
esac
dry=${DRY_RUN:-0}
[ "$dry" = 0 ] || [ "$dry" = 1 ] || die "DRY_RUN must be 0 or 1"
today=${REBASE_DATE:-$(date -u +%F)}
label=$(printf '%s' "$ref" | tr -c 'A-Za-z0-9._-' '-')
mkdir -p "$BUILD"
work=$BUILD/rebase-$label
log=$BUILD/rebase-$label.log
rm -rf "$work"
mkdir -p "$work"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/rebase.XXXXXX")
keep_work=0
cleanup() { rm -rf "$tmp"; [ "$keep_work" = 1 ] || rm -rf "$work"; }
trap cleanup EXIT
: >"$log"
out() { printf '%s\n' "$*" | tee -a "$log"; }          # the table and results: stdout and the log
info() { printf '%s\n' "$*" >>"$log"; printf '==> %s\n' "$*" >&2; }
fail() { printf 'error: %s\n' "$*" | tee -a "$log" >&2; exit 1; }

envs=''
for v in DRY_RUN SHA256 GIT REBASE_SDIST REBASE_DATE PATCHES PIN_FILE; do
  [ -z "${!v:-}" ] || [ "$v:${!v}" = "PATCHES:$ROOT/patches" ] || [ "$v:${!v}" = "PIN_FILE:$ROOT/pin.env" ] ||
    envs+="$v=${!v} "
done
out "# ${envs}scripts/rebase.sh $to   (make rebase TO=$to; $(date -u '+%F %T') UTC)"

# The scripts read the pin from PIN_FILE; the new pin's pristine tree is built by the same
# pristine_tree.sh from a shadow copy of scripts/ outside this repository, so its gitlink check
# (the old pin's) does not apply and nothing here is touched.
shadow=$tmp/root
mkdir -p "$shadow"
cp -a "$ROOT/scripts" "$shadow/"
pin_file_for() {  # pin_file_for VERSION SHA256 COMMIT: print the path of a throwaway pin file
  local f
  f=$(mktemp "$tmp/pin.XXXXXX")
  printf 'MCORE_VERSION=%s\nMCORE_SDIST_SHA256=%s\nMCORE_GIT_COMMIT=%s\nLOCAL_LABEL=%s\n' "$1" "$2" "$3" "$LOCAL_LABEL" >"$f"
  echo "$f"
}
pristine() {  # pristine CHANNEL VERSION SHA256 COMMIT UPSTREAM_DIR SDIST_FILE DEST
  local pin
  pin=$(pin_file_for "$2" "$3" "$4")
  env PIN_FILE="$pin" UPSTREAM="$5" SDIST="$6" CHANNEL="$1" VENV="$VENV" CACHE="$CACHE" \
    BUILD="$tmp/build" DIST="$tmp/dist" PATCHES="$PATCHES" GIT_CEILING_DIRECTORIES="$tmp" \
    bash "$shadow/scripts/pristine_tree.sh" "$7" >/dev/null 2>>"$log"
}

# ---- git history: a bare repository in build/ that borrows upstream/'s objects when it is filled
gitdir=$BUILD/rebase-git
url=$(git config -f "$ROOT/.gitmodules" submodule.upstream.url 2>/dev/null || true)
gitq() { git --git-dir="$gitdir" -c protocol.file.allow=always "$@"; }
have_history=0
init_git() {
  [ -d "$gitdir" ] || git init -q --bare "$gitdir"
  if submodule_filled; then
    git -C "$UPSTREAM" rev-parse --path-format=absolute --git-common-dir | sed 's|$|/objects|' \
      >"$gitdir/objects/info/alternates"
    have_history=1
  fi
}
resolve_ref() {  # resolve_ref REF: print the commit, fetching REF from the upstream URL if needed
  local r=$1
  if [[ $r =~ ^[0-9a-f]{40}$ ]] && gitq cat-file -e "$r^{commit}" 2>/dev/null; then echo "$r"; return 0; fi
  local depth=()
  [ "$have_history" = 1 ] || depth=(--depth=1)  # no local history to borrow: fetch the one commit
  if [ -n "$url" ] && gitq fetch -q --no-tags "${depth[@]}" "$url" "+$r:refs/rebase/target" 2>>"$log"; then
    gitq rev-parse "refs/rebase/target^{commit}"; return 0
  fi
  if gitq rev-parse -q --verify "$r^{commit}" 2>/dev/null; then return 0; fi
  if [ -n "$url" ] && [[ $r =~ ^[0-9a-f]{4,40}$ ]]; then
    info "fetching all branches and tags of $url to find commit $r"
    gitq fetch -q --no-tags "$url" '+refs/heads/*:refs/rebase/heads/*' '+refs/tags/*:refs/rebase/tags/*' 2>>"$log" || true
    gitq rev-parse -q --verify "$r^{commit}" 2>/dev/null && return 0
  fi
  return 1
}
checkout_commit() {  # checkout_commit COMMIT DIR: a clean checkout of COMMIT at DIR (for pristine_tree.sh)
  gitq update-ref "refs/rebase/co-$1" "$1"
  git -c protocol.file.allow=always clone -q --shared --no-checkout "$gitdir" "$2" 2> >(grep -v 'cloned an empty repository' >>"$log")
  git -C "$2" -c advice.detachedHead=false checkout -q --detach "$1"
}

# ---- the new pristine tree (and what the new pin will say)
new_version='' new_sha='' new_commit='' commit_how='' sdist_file='' downloaded=''
git_note=''
if [ "$kind" = pypi ]; then
  ver=$ref
  IFS=. read -r vmaj vmin vpat _ <<<"${ver%%[a-z]*}"
  name=megatron_core-$ver.tar.gz
  if [ -n "${REBASE_SDIST:-}" ]; then
    [ -f "$REBASE_SDIST" ] || fail "REBASE_SDIST=$REBASE_SDIST: no such file"
    sdist_file=$REBASE_SDIST
    info "using the local sdist $sdist_file (REBASE_SDIST)"
  elif [ -n "${SHA256:-}" ] && [ -f "$CACHE/$name" ] && [ "$(sha256_of "$CACHE/$name")" = "$SHA256" ]; then
    sdist_file=$CACHE/$name
  else
    mkdir -p "$work/dl"
    if [ -n "${SHA256:-}" ]; then
      echo "megatron-core==$ver --hash=sha256:$SHA256" >"$work/req.txt"
      info "downloading megatron-core $ver sdist from PyPI (pip, --require-hashes $SHA256)"
      "$py" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        --require-hashes -r "$work/req.txt" -d "$work/dl" >>"$log" 2>&1 ||
        fail "pip could not download megatron-core==$ver with sha256 $SHA256 (see $log)"
    else
      info "downloading megatron-core $ver sdist from PyPI (pip checks the index's sha256; pass SHA256= to pin it yourself)"
      "$py" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        "megatron-core==$ver" -d "$work/dl" >>"$log" 2>&1 ||
        fail "pip could not download the megatron-core==$ver sdist (no such version on PyPI, or no network; see $log)"
    fi
    sdist_file=$work/dl/$name
    [ -f "$sdist_file" ] || fail "pip did not produce $name (got: $(ls "$work/dl"))"
    downloaded=$sdist_file
  fi
  new_version=$ver
  new_sha=$(sha256_of "$sdist_file")
  [ -z "${SHA256:-}" ] || [ "$new_sha" = "$SHA256" ] || fail "$sdist_file: sha256 $new_sha, not SHA256=$SHA256"
  pristine sdist "$ver" "$new_sha" '' /nonexistent "$sdist_file" "$work/new" ||
    fail "could not lay out the $ver sdist as a pristine tree (see $log)"

  # the git channel: which commit gives this tree?
  cands=() hows=()
  add_cand() {
    local c
    c=$(gitq rev-parse -q --verify "$1^{commit}" 2>/dev/null) || return 0
    for x in "${cands[@]}"; do [ "$x" = "$c" ] && return 0; done
    cands+=("$c") hows+=("$2")
  }
  try_cands() {  # the candidates in cands/hows, in order; sets new_commit on a match
    local i c cv bad co d
    for i in "${!cands[@]}"; do
      c=${cands[$i]}
      [ -z "${tried[$c]:-}" ] || continue
      tried[$c]=1
      cv=$(helpers version-of-commit "$gitdir" "$c")
      if [ "$cv" != "$vmaj.$vmin.${vpat:-0}" ] && [ -z "${GIT:-}" ]; then
        info "candidate ${c:0:10} (${hows[$i]}): its package_info.py says ${cv:-nothing}, not $ver"
        continue
      fi
      bad=$(helpers blob-mismatch "$work/new" "$gitdir" "$c")
      if [ -n "$bad" ]; then
        info "candidate ${c:0:10} (${hows[$i]}): differs from the sdist in $(wc -l <<<"$bad") file(s), e.g. $(head -n 1 <<<"$bad")"
        continue
      fi
      co=$tmp/co-${c:0:12}
      checkout_commit "$c" "$co"
      if ! pristine git "$ver" "$new_sha" "$c" "$co" '' "$tmp/git-${c:0:12}"; then
        info "candidate ${c:0:10} (${hows[$i]}): the git channel does not give version $ver (see $log)"
        continue
      fi
      if d=$(diff -r "$work/new" "$tmp/git-${c:0:12}" 2>&1); then
        new_commit=$c commit_how=${hows[$i]}
        info "git channel: ${c:0:10} (${commit_how}) gives the same pristine tree as the $ver sdist"
        return 0
      fi
      info "candidate ${c:0:10} (${hows[$i]}): pristine trees differ: $(head -n 3 <<<"$d")"
    done
    return 1
  }
  declare -A tried=()
  if [ -n "${GIT:-}" ]; then
    init_git
    c=$(resolve_ref "$GIT") || fail "GIT=$GIT: no such commit in upstream/ or at $url"
    add_cand "$c" "given as GIT=$GIT"
    try_cands || fail "GIT=$GIT does not give the same pristine tree as the $ver sdist (see $log)"
  elif submodule_filled; then
    init_git
    missing=$(helpers missing-blobs "$work/new" "$gitdir" | head -n 5)
    if [ -n "$missing" ]; then
      info "the $ver sdist has files whose exact content is in no commit of the local Megatron-LM history:"
      while read -r l; do info "  $l"; done <<<"$missing"
      git_note="$(helpers missing-blobs "$work/new" "$gitdir" | wc -l) of its megatron/ files are in no commit of the local Megatron-LM history"
    else
      # 1. the release tags and their parents; 2. commits of the release branch with this version
      for t in "core_v$ver" "v$ver"; do
        gitq fetch -q --no-tags "$url" "+refs/tags/$t:refs/rebase/tags/$t" 2>/dev/null || true
        if gitq rev-parse -q --verify "refs/rebase/tags/$t" >/dev/null; then
          add_cand "refs/rebase/tags/$t" "tag $t"
          add_cand "refs/rebase/tags/$t^" "the parent of tag $t"
          add_cand "refs/rebase/tags/$t^^" "the grandparent of tag $t"
        fi
      done
      if ! try_cands; then
        for b in "core_r$vmaj.$vmin.0" "core_r$ver"; do
          gitq fetch -q --no-tags "$url" "+refs/heads/$b:refs/rebase/heads/$b" 2>/dev/null || continue
          while read -r c v; do
            [ "$v" = "$vmaj.$vmin.${vpat:-0}" ] && add_cand "$c" "on branch $b"
          done < <(gitq rev-list --first-parent -n 300 "refs/rebase/heads/$b" | helpers versions "$gitdir")
        done
        try_cands ||
          git_note="no tag core_v$ver / v$ver (or its parents) nor release-branch commit of version $ver gives the sdist's tree (tried ${#cands[@]})"
      fi
    fi
  else
    git_note="upstream/ is not filled, so no Megatron-LM history was searched"
  fi
  [ -n "$new_commit" ] || info "only the PyPI channel is known for $ver: $git_note"
else
  init_git
  [ "$have_history" = 1 ] || [ -n "$url" ] || fail "no Megatron-LM history: fill upstream/ (git submodule update --init upstream)"
  new_commit=$(resolve_ref "$ref") || fail "git ref '$ref' not found in upstream/ nor at $url"
  commit_how="$ref"
  checkout_commit "$new_commit" "$tmp/co"
  pristine git '' '' "$new_commit" "$tmp/co" '' "$work/new" ||
    fail "could not lay out Megatron-LM $new_commit as a pristine tree (see $log)"
  info "the pin will be git-only: $ref is Megatron-LM $new_commit, which has no PyPI sdist pinned (a release: TO=<version> GIT=<ref> pins both channels)"
fi
pkg_version=$(cd "$work/new" && NO_VCS_VERSION=1 "$py" -c \
  'import runpy; print(runpy.run_path("megatron/core/package_info.py")["__version__"])')
date_of() { gitq log -1 --format=%cs "$1" 2>/dev/null || true; }

# what the old and new pins are called in the table and in the patch headers
describe_pin() {  # describe_pin VERSION COMMIT
  if [ -n "$1" ] && [ -n "$2" ]; then echo "megatron-core $1 (git $2)"
  elif [ -n "$1" ]; then echo "megatron-core $1 (PyPI sdist only; no git commit known)"
  else echo "Megatron-LM git $2 (package version $pkg_version; no PyPI sdist)"
  fi
}
old_desc=$(describe_pin "${MCORE_VERSION:-}" "${MCORE_GIT_COMMIT:-}")
base=$(describe_pin "$new_version" "$new_commit")
if [ "$kind" = git ] && [ -n "$new_commit" ] && [ "$ref" != "$new_commit" ]; then
  base="Megatron-LM git $new_commit ($ref on $(date_of "$new_commit"); package version $pkg_version; no PyPI sdist)"
fi

if [ "$kind" = pypi ]; then short="megatron-core $new_version"; else short="Megatron-LM ${new_commit:0:10}${commit_how:+ ($commit_how)}"; fi
[ "$kind" = git ] && [ "$ref" = "$new_commit" ] && short="Megatron-LM ${new_commit:0:10}"

# upstream's tests/ (git channel only), for patches that touch them
tree=$work/tree
mv "$work/new" "$tree"
tests_added=0
needs_tests=0
mapfile -t plist < <(series)
for p in "${plist[@]}"; do helpers touches-tests "$PATCHES/$p" && needs_tests=1; done
if [ "$needs_tests" = 1 ] && [ -n "$new_commit" ]; then
  gitq archive "$new_commit" tests | tar -x -C "$tree"
  tests_added=1
fi

# ---- carry the series over, with quilt's stable settings from lib.sh, on copies in the work dir
wp=$work/patches
mkdir -p "$wp"
cp -a "$PATCHES/." "$wp/"
export QUILT_PATCHES=$wp QUILT_SERIES=$work/series.pushed QUILT_PC=.pc
: >"$QUILT_SERIES"
cat >"$work/quiltrc" <<EOF
# quilt settings of this rebase (scripts/lib.sh's stable ones): quilt --quiltrc $work/quiltrc ...
QUILT_PATCHES=$wp
QUILT_SERIES=$QUILT_SERIES
QUILT_PUSH_ARGS="$QUILT_PUSH_ARGS"
QUILT_REFRESH_ARGS="$QUILT_REFRESH_ARGS"
QUILT_DIFF_ARGS="$QUILT_DIFF_ARGS"
QUILT_PATCH_OPTS="$QUILT_PATCH_OPTS"
QUILT_DIFF_OPTS="$QUILT_DIFF_OPTS"
EOF
patch_args=(-p1 -F0 -t -u -V never --no-backup-if-mismatch -r -)
rows=() dropped=() refreshed=() conflicted=''
fwd_check() {  # fwd_check DIR PATCH: dry run forward, -F0 -N; prints patch's output
  patch -d "$1" --dry-run -N "${patch_args[@]}" -i "$2" 2>&1
}
rev_check() {
  patch -d "$1" --dry-run -R "${patch_args[@]}" -i "$2" 2>&1
}
probe=''
for p in "${plist[@]}"; do
  f=$wp/$p
  [ -f "$f" ] || fail "patches/series names $p, which is not in patches/"
  suffix=''
  dir=$tree
  if [ -n "$conflicted" ]; then dir=$probe suffix=" [checked without $conflicted]"; fi
  if helpers tests-only "$f" && [ ! -d "$dir/tests" ]; then
    rows+=("$p|kept, not checked (tests only; no upstream tests/ for this target: the pin has no git commit)$suffix")
    continue
  fi
  if o=$(fwd_check "$dir" "$f"); then
    if grep -qE 'offset|fuzz' <<<"$o"; then verdict=offset; else verdict=clean; fi
  elif r=$(rev_check "$dir" "$f"); then
    verdict=upstream
    printf '%s\n' "--- $p: forward (-F0 -N) dry run:" "$o" "--- reverse (-R -F0) dry run:" "$r" >>"$log"
  else
    verdict=conflict
    printf '%s\n' "--- $p: forward (-F0 -N) dry run:" "$o" "--- reverse (-R -F0) dry run:" "$r" >>"$log"
  fi
  if [ -n "$conflicted" ]; then  # after a conflict: a verdict only, on the probe tree
    case $verdict in
      clean) patch -d "$probe" -N "${patch_args[@]}" -s -i "$f" >/dev/null 2>&1; rows+=("$p|applies cleanly$suffix") ;;
      offset) patch -d "$probe" -N "${patch_args[@]}" -s -i "$f" >/dev/null 2>&1; rows+=("$p|applied only with offset or fuzz (needs a refresh)$suffix") ;;
      upstream) rows+=("$p|already in upstream (its reverse applies with -F0)$suffix") ;;
      conflict) rows+=("$p|conflicts$suffix") ;;
    esac
    continue
  fi
  case $verdict in
    clean | offset)
      echo "$p" >>"$QUILT_SERIES"
      (cd "$tree" && quilt push -q </dev/null) >>"$log" 2>&1 || fail "quilt push $p failed after a clean dry run (see $log)"
      if [ "$verdict" = offset ]; then
        printf '%s\n' "--- $p: forward dry run (-F0):" "$o" >>"$log"
        (cd "$tree" && quilt refresh) >>"$log" 2>&1 || fail "quilt refresh $p failed (see $log)"
        refreshed+=("$p")
        rows+=("$p|applied only with offset or fuzz (refreshed, diff shown)")
      else
        rows+=("$p|applies cleanly")
      fi
      ;;
    upstream)
      helpers series-drop "$wp/series" "$p"
      rm -f "$f"
      dropped+=("$p")
      rows+=("$p|already in upstream (its reverse applies with -F0: dropped from series, file deleted)")
      ;;
    conflict)
      conflicted=$p
      probe=$work/probe
      cp -a "$tree" "$probe"
      fz=$(patch -d "$tree" --dry-run -N -p1 -F2 -t -u -V never -r - -i "$f" 2>&1) && hint="it would apply with fuzz 2 (the context changed near a hunk)" ||
        hint="$(grep -oE '[0-9]+ out of [0-9]+ hunks? FAILED' <<<"$fz" | sed 's/ FAILED/ fail/' | paste -sd, -) even with fuzz 2"
      echo "$p" >>"$QUILT_SERIES"
      (cd "$tree" && quilt push -f -q </dev/null) >>"$log" 2>&1 || true
      rows+=("$p|conflicts ($hint)")
      ;;
  esac
done
rm -rf "$probe"

# ---- the table
out ""
out "from: $old_desc"
out "to:   $base"
if [ "$kind" = pypi ]; then
  out "      PyPI sdist megatron_core-$new_version.tar.gz sha256 $new_sha"
  if [ -n "$new_commit" ]; then out "      git channel: $new_commit ($commit_how)"
  else out "      git channel: unknown ($git_note); the pin would be PyPI-only"; fi
else
  out "      git-only pin (no PyPI sdist); package version $pkg_version"
fi
[ "$tests_added" = 1 ] && out "      upstream tests/ from $new_commit added to the tree (for tests-only patches)"
out ""
w=0
for r in "${rows[@]}"; do n=${r%%|*}; [ ${#n} -gt $w ] && w=${#n}; done
for r in "${rows[@]}"; do out "$(printf "  %-${w}s  %s" "${r%%|*}" "${r#*|}")"; done
out ""
for p in "${refreshed[@]}"; do
  out "refreshed $p (old -> new; only the placement of its hunks moved):"
  out "$(diff -u --label "patches/$p" --label "patches/$p (refreshed)" "$PATCHES/$p" "$wp/$p" || true)"
  out ""
done
for p in "${dropped[@]}"; do
  origin=$(grep -m1 -E '^Origin:' "$PATCHES/$p" || true)
  out "dropped $p: its reverse applies with -F0 to the new pristine tree, so $short already has this change (${origin:-no Origin: field})."
  out "  commit message line: \"Drop $p: in upstream since $short\""
  out ""
done

if [ -n "$conflicted" ]; then
  keep_work=1
  rejs=$(cd "$tree" && find . -name '*.rej' -not -path './.pc/*' | sed 's|^\./||' | sort)
  out "CONFLICT: $conflicted does not apply with fuzz 0 to $short, and $short does not have it either."
  out "Nothing was changed: pin.env and patches/ are as they were."
  out "The work tree ${tree#"$ROOT"/} has the series pushed up to $conflicted (forced), rejected hunks in:"
  for r in $rejs; do out "    ${tree#"$ROOT"/}/$r"; done
  out "Next step:"
  out "  cd ${tree#"$ROOT"/}"
  out "  # port each rejected hunk by hand into the file next to its .rej, delete the .rej, then"
  out "  quilt --quiltrc ../quiltrc refresh            # writes ${wp#"$ROOT"/}/$conflicted"
  out "  cp ../patches/$conflicted $PATCHES/   # the ported patch (it fits the new pin only)"
  out "  make rebase TO=$to                             # again, from the top; it must now apply"
  out "Log: ${log#"$ROOT"/}"
  exit 3
fi

# ---- success: the strict check (apply_patches.sh, zero offset) on the new tree, then the rewrite
(cd "$tree" && quilt pop -a -q) >>"$log" 2>&1 || fail "quilt pop -a failed in $tree (see $log)"
rm -rf "$tree/.pc"
new_pin=$work/pin.env
if [ "$kind" = pypi ]; then
  note1=''
  if [ -n "$new_commit" ]; then
    note2="${new_commit:0:8} ($commit_how) gives the same pristine tree as the $new_version sdist (make rebase, $today)."
  else
    note2="Empty: no known Megatron-LM commit gives the $new_version sdist's tree (make rebase, $today), so the pin
is PyPI-only; the upstream/ gitlink is not part of it until this is set (make rebase TO=$new_version GIT=<commit>)."
  fi
else
  note1="Empty: the pin is git-only: Megatron-LM $new_commit has no PyPI sdist pinned (make rebase, $today)."
  note2="$ref as of $(date_of "$new_commit"): Megatron-LM ${new_commit:0:10}, package version $pkg_version (make rebase, $today)."
fi
helpers pin-write "$PIN_FILE" "$new_pin" "MCORE_VERSION=$new_version" "MCORE_SDIST_SHA256=${new_version:+$new_sha}" \
  "MCORE_GIT_COMMIT=$new_commit" --note1 "$note1" --note2 "$note2"
old_v=${MCORE_VERSION:-}
[ -z "$old_v" ] || sed -i "s/^\(#.*\): ${old_v//./\\.}+<label>/\1: ${new_version:-$pkg_version}+<label>/" "$new_pin"
for p in $(PATCHES=$wp series); do
  changed=()
  for x in "${refreshed[@]}"; do [ "$x" = "$p" ] && changed=(--changed); done
  helpers header "$wp/$p" "$base" "$today" "${changed[@]}" >/dev/null
done
# the series as the build will apply it: must pass apply_patches.sh (fuzz 0, no offset)
env PIN_FILE="$new_pin" PATCHES="$wp" VENV="$VENV" bash "$shadow/scripts/apply_patches.sh" --check "$tree" >>"$log" 2>&1 ||
  fail "the carried-over series fails apply_patches.sh --check on the new tree (see $log)"

out "pin.env would become:"
out "$(diff -u --label pin.env --label 'pin.env (new)' "$PIN_FILE" "$new_pin" || true)"
summary="$((${#rows[@]} - ${#dropped[@]} - ${#refreshed[@]})) kept as is, ${#refreshed[@]} refreshed, ${#dropped[@]} dropped"
if [ "$dry" = 1 ]; then
  out ""
  out "DRY RUN: nothing changed ($summary). Without DRY_RUN=1 pin.env, patches/ and the upstream/ gitlink are rewritten."
  out "Log: ${log#"$ROOT"/}"
  exit 0
fi

# the upstream/ gitlink first (the step that can fail), then the files
in_repo=0
if [ "$(git -C "$ROOT" rev-parse --show-toplevel 2>/dev/null)" = "$ROOT" ] &&
  git -C "$ROOT" ls-files -s -- upstream | grep -q '^160000'; then in_repo=1; fi
gitlink_msg="upstream/ gitlink unchanged"
if [ -n "$new_commit" ] && [ "$in_repo" = 1 ] && [ "$(gitlink_commit)" != "$new_commit" ]; then
  if submodule_filled; then
    [ -z "$(git -C "$UPSTREAM" status --porcelain)" ] ||
      fail "upstream/ has local changes; clean it before the rebase moves it (nothing was changed)"
    if ! git -C "$UPSTREAM" cat-file -e "$new_commit^{commit}" 2>/dev/null; then
      gitq update-ref refs/rebase/pinned "$new_commit"
      git -C "$UPSTREAM" -c protocol.file.allow=always fetch -q "$gitdir" refs/rebase/pinned 2>>"$log" ||
        fail "could not fetch $new_commit into upstream/ (nothing was changed; see $log)"
    fi
    git -C "$UPSTREAM" -c advice.detachedHead=false checkout -q --detach "$new_commit" ||
      fail "could not check out $new_commit in upstream/ (nothing was changed)"
  fi
  git -C "$ROOT" update-index --cacheinfo "160000,$new_commit,upstream"
  gitlink_msg="upstream/ gitlink -> $new_commit (staged: git diff --cached upstream)"
  submodule_filled || gitlink_msg="$gitlink_msg; then: git submodule update upstream"
elif [ -z "$new_commit" ] && [ "$in_repo" = 1 ]; then
  gitlink_msg="upstream/ gitlink left at $(gitlink_commit) (not part of a PyPI-only pin)"
fi
cp "$new_pin" "$PIN_FILE"
for p in "${dropped[@]}"; do rm -f "$PATCHES/$p"; done
for p in $(PATCHES=$wp series); do cp "$wp/$p" "$PATCHES/$p"; done
cp "$wp/series" "$PATCHES/series"
if [ -n "$downloaded" ]; then mkdir -p "$CACHE" && cp "$downloaded" "$CACHE/"; fi
out ""
out "REBASED ($summary): pin.env and patches/ rewritten; $gitlink_msg."
out "LOCAL_LABEL is still $LOCAL_LABEL. Review: git status; git diff. Then: make check-patches && make test."
out "Log: ${log#"$ROOT"/}"
