# Sourced: a cluster of N emulated machines on this one, for what crosses a network between
# machines. Each node is a network namespace with its own UTS namespace and hostname (lockstep
# tells machines apart by hostname and boot id, so namespaces that shared the hostname would be
# one machine, and the auto and hier backends would take shared memory past the links). The
# nodes hang off one bridge in a hub namespace, one veth pair each, as machines on a switch;
# nothing is added to this machine's own network namespace. Each node's link can be
# rate-limited in both directions with a token bucket (tc tbf on the node's end and the
# switch's). Delay cannot be emulated here: the kernel has no netem, so the links are as fast to
# answer as the machine's loopback, and only their rate is a real network's.
#
#   shaped_cluster_up N        N nodes (2-8): sets sc_ns[i], sc_addr[i], sc_host[i] (i = 0..N-1)
#                              and removes the cluster on EXIT, INT or TERM
#   shaped_cluster_rate RATE   rate-limits every node's link (a tc rate: 1gbit, 100mbit), or
#                              lifts the limit (none)
#   sc_exec I CMD...           runs CMD on node I: its namespaces and hostname, in this directory
#   shaped_cluster_down        kills what runs on the nodes and removes the cluster
#   shaped_cluster_leftovers   prints what of any such cluster is left (namespaces, links, qdiscs)
#
# Needs root and iproute2 (ip, tc; scripts/install-deps.sh installs it); a caller that defines
# skip() is told why when the machine cannot make namespaces (exit 77 in ctest), else fail().
sc_prefix=lsc$(($$ % 100000))

shaped_cluster_up() {
  local n=$1 i
  [ "$n" -ge 2 ] && [ "$n" -le 8 ] || fail "a shaped cluster has 2 to 8 nodes, not '$n'"
  local cannot=fail
  declare -F skip > /dev/null && cannot=skip
  [ "$(id -u)" -eq 0 ] || "$cannot" "needs root to create network namespaces (run as root)"
  command -v ip > /dev/null && command -v tc > /dev/null ||
    "$cannot" "'ip' or 'tc' not found (install iproute2: scripts/install-deps.sh)"
  trap 'shaped_cluster_down' EXIT
  trap 'shaped_cluster_down; exit 130' INT
  trap 'shaped_cluster_down; exit 143' TERM
  sc_hub=${sc_prefix}hub
  sc_nodes=$n
  ip netns add "$sc_hub" 2> /dev/null || "$cannot" "'ip netns add' failed (needs CAP_SYS_ADMIN)"
  ip -n "$sc_hub" link add br0 type bridge || fail "cannot create a bridge in $sc_hub"
  ip -n "$sc_hub" link set br0 up || fail "cannot bring up the bridge"
  local subnet=10.233.$(($$ % 250 + 1))
  for ((i = 0; i < n; i++)); do
    sc_ns[i]=${sc_prefix}n$i
    sc_addr[i]=$subnet.$((i + 1))
    sc_host[i]=${sc_prefix}-node$i
    ip netns add "${sc_ns[i]}" || fail "cannot create namespace ${sc_ns[i]}"
    # The pair is made inside the hub, so no end of it ever shows in this machine's namespace.
    ip -n "$sc_hub" link add "port$i" type veth peer name eth0 netns "${sc_ns[i]}" ||
      fail "cannot create node $i's link"
    ip -n "$sc_hub" link set "port$i" master br0 up || fail "cannot plug node $i into the bridge"
    ip -n "${sc_ns[i]}" addr add "${sc_addr[i]}/24" dev eth0 || fail "cannot address node $i"
    ip -n "${sc_ns[i]}" link set lo up || fail "cannot bring up lo on node $i"
    ip -n "${sc_ns[i]}" link set eth0 up || fail "cannot bring up node $i's link"
  done
}

shaped_cluster_rate() {
  local rate=$1 i
  for ((i = 0; i < sc_nodes; i++)); do
    tc -n "${sc_ns[i]}" qdisc del dev eth0 root 2> /dev/null || true
    tc -n "$sc_hub" qdisc del dev "port$i" root 2> /dev/null || true
    [ "$rate" = none ] && continue
    # A bucket of ~1 ms of traffic at the rate (at least 64 KiB, a GSO segment's worth), and
    # up to 50 ms of queue: a switch port's buffer, not a shaper that drops.
    local burst
    burst=$(tc_burst "$rate")
    tc -n "${sc_ns[i]}" qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms ||
      fail "cannot rate-limit node $i's uplink to $rate"
    tc -n "$sc_hub" qdisc add dev "port$i" root tbf rate "$rate" burst "$burst" latency 50ms ||
      fail "cannot rate-limit node $i's downlink to $rate"
  done
}

# tc_burst RATE: ~1 ms of RATE in bytes, at least 65536.
tc_burst() {
  local rate=${1,,} bits
  case "$rate" in
    *gbit) bits=$((${rate%gbit} * 1000000000)) ;;
    *mbit) bits=$((${rate%mbit} * 1000000)) ;;
    *kbit) bits=$((${rate%kbit} * 1000)) ;;
    *) fail "a rate is <number>gbit, mbit or kbit, not '$1'" ;;
  esac
  local b=$((bits / 8 / 1000))
  echo $((b > 65536 ? b : 65536))
}

sc_exec() {
  local i=$1
  shift
  ip netns exec "${sc_ns[i]}" unshare --uts sh -c 'hostname "$0" && exec "$@"' "${sc_host[i]}" "$@"
}

shaped_cluster_down() {
  local ns pid
  for ns in $(ip netns list 2> /dev/null | awk -v p="$sc_prefix" 'index($1, p) == 1 {print $1}'); do
    for pid in $(ip netns pids "$ns" 2> /dev/null); do kill -KILL "$pid" 2> /dev/null || true; done
    ip netns del "$ns" 2> /dev/null || true
  done
}

shaped_cluster_leftovers() {
  # Namespaces of any shaped cluster (another run's too), and anything of ours that leaked into
  # this machine's namespace: a link named after the prefix, or a qdisc on one.
  ip netns list 2> /dev/null | awk '$1 ~ /^lsc[0-9]+(hub|n[0-9])$/ {print "namespace " $1}'
  ip -o link show 2> /dev/null | awk -F': ' '$2 ~ /^lsc[0-9]/ {print "link " $2}'
  tc qdisc show 2> /dev/null | awk '/ dev lsc[0-9]/ {print "qdisc " $0}'
}
