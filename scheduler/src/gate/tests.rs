//! Unit tests of the gate inside one process.

use super::shm;
use super::*;
use std::sync::atomic::AtomicUsize;
use std::thread;

#[test]
fn park_unpark_transitions() {
    let g = Gate::new();
    assert!(!g.is_parked());
    assert_eq!(g.wait_while_parked(), WaitOutcome::Running);
    assert!(g.park());
    assert!(!g.park());
    assert!(g.is_parked());
    assert_eq!(g.wait_while_parked_timeout(Duration::from_millis(5)), None);
    assert!(g.unpark());
    assert!(!g.unpark());
    assert!(g.apply(Action::Park));
    assert!(g.apply(Action::Unpark));
    assert_eq!(g.park_count(), 2);
}

#[test]
fn kick_runs_once_per_park() {
    let g = Gate::new();
    let kicks = Arc::new(AtomicUsize::new(0));
    let k = kicks.clone();
    g.set_kick(move || {
        k.fetch_add(1, Ordering::SeqCst);
    });
    g.park();
    g.park();
    g.unpark();
    g.park();
    assert_eq!(kicks.load(Ordering::SeqCst), 2);
    g.clear_kick();
    g.unpark();
    g.park();
    assert_eq!(kicks.load(Ordering::SeqCst), 2);
}

/// Simulated vCPU threads: spin "running" while unparked, block on the
/// gate while parked. Parking stops all progress; unparking resumes it.
#[test]
fn threads_stop_while_parked_and_resume() {
    let gate = Arc::new(Gate::new());
    let progress = Arc::new(AtomicU64::new(0));
    let kicked = Arc::new(AtomicUsize::new(0));
    {
        let k = kicked.clone();
        gate.set_kick(move || {
            k.fetch_add(1, Ordering::SeqCst);
        });
    }
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let gate = gate.clone();
            let progress = progress.clone();
            thread::spawn(move || {
                loop {
                    if gate.is_parked() {
                        if gate.wait_while_parked() == WaitOutcome::Shutdown {
                            return;
                        }
                        continue;
                    }
                    if gate.is_shutdown() {
                        return;
                    }
                    progress.fetch_add(1, Ordering::Relaxed);
                    thread::yield_now();
                }
            })
        })
        .collect();

    let wait_progress = |from: u64| {
        let t0 = Instant::now();
        while progress.load(Ordering::Relaxed) <= from + 100 {
            assert!(t0.elapsed() < Duration::from_secs(10), "no progress");
            thread::yield_now();
        }
    };
    wait_progress(0);
    for _ in 0..3 {
        gate.park();
        // Let in-flight iterations finish, then check progress froze.
        thread::sleep(Duration::from_millis(20));
        let frozen = progress.load(Ordering::Relaxed);
        thread::sleep(Duration::from_millis(30));
        assert_eq!(progress.load(Ordering::Relaxed), frozen, "ran while parked");
        gate.unpark();
        wait_progress(frozen);
    }
    assert_eq!(kicked.load(Ordering::SeqCst), 3);

    // Shutdown releases threads blocked on a parked gate.
    gate.park();
    thread::sleep(Duration::from_millis(20));
    gate.shutdown();
    assert!(!gate.park(), "park after shutdown is ignored");
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(gate.wait_while_parked(), WaitOutcome::Shutdown);
}

#[test]
fn timeout_wait_sees_unpark_from_other_thread() {
    let gate = Arc::new(Gate::new());
    gate.park();
    let g = gate.clone();
    let t = thread::spawn(move || g.wait_while_parked_timeout(Duration::from_secs(10)));
    thread::sleep(Duration::from_millis(10));
    gate.unpark();
    assert_eq!(t.join().unwrap(), Some(WaitOutcome::Running));
}

/// A watcher thread runs the kick once per park it sees, and ends on
/// shutdown.
#[test]
fn watcher_kicks_once_per_park_and_ends_on_shutdown() {
    let gate = Arc::new(Gate::new());
    let kicks = Arc::new(AtomicUsize::new(0));
    let k = kicks.clone();
    gate.set_kick(move || {
        k.fetch_add(1, Ordering::SeqCst);
    });
    let w = gate.spawn_watcher("watch").unwrap();
    let wait_kicks = |n: usize| {
        let t0 = Instant::now();
        while kicks.load(Ordering::SeqCst) < n {
            assert!(t0.elapsed() < Duration::from_secs(10), "no kick {n}");
            thread::sleep(Duration::from_millis(1));
        }
    };
    // The owner's own park also kicks (same callback): 2 per park here.
    gate.park();
    wait_kicks(2);
    gate.unpark();
    gate.park();
    wait_kicks(4);
    gate.shutdown();
    w.join().unwrap();
    assert_eq!(kicks.load(Ordering::SeqCst), 4);
}

/// Both sides in one process (a memfd mapped twice): the peer waits, the
/// owner decides; the peer cannot park or unpark.
#[test]
fn peer_waits_on_the_owner_and_cannot_decide() {
    let (owner, fd) = Gate::new_shared().unwrap();
    let peer = Gate::from_fd(fd).unwrap();
    assert_eq!((owner.side(), peer.side()), (Side::Owner, Side::Peer));
    assert!(owner.park());
    assert!(peer.is_parked());
    assert!(!peer.unpark(), "a peer does not decide");
    assert!(owner.is_parked());
    let p = peer.clone();
    let t = thread::spawn(move || p.wait_while_parked());
    let t0 = Instant::now();
    while owner.waiting() == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10));
        thread::sleep(Duration::from_millis(1));
    }
    assert!(
        !t.is_finished(),
        "the peer's waiter must block while parked"
    );
    assert!(owner.unpark());
    assert_eq!(t.join().unwrap(), WaitOutcome::Running);
    assert_eq!(peer.park_count(), 1);
    // The peer's shutdown releases its own waiters, not the owner's view.
    owner.park();
    peer.shutdown();
    assert_eq!(peer.wait_while_parked(), WaitOutcome::Shutdown);
    assert!(owner.is_parked() && !owner.is_shutdown());
}

/// A peer that writes garbage into the page: the owner's state, decisions
/// and waits are unaffected, and its reads of peer counters are bounded.
#[test]
fn garbage_from_the_peer_does_not_move_the_owner() {
    let (owner, fd) = Gate::new_shared().unwrap();
    let raw = shm::Mapping::from_fd(&fd).unwrap();
    let b = raw.block();
    b.state.store(u32::MAX, Ordering::SeqCst);
    b.waiting.store(u32::MAX, Ordering::SeqCst);
    b.watchers.store(u32::MAX, Ordering::SeqCst);
    b.cpu_vcpus.store(u32::MAX, Ordering::SeqCst);
    for s in &b.cpu_ns {
        s.store(u64::MAX, Ordering::SeqCst);
    }
    assert!(!owner.is_parked() && !owner.is_shutdown());
    assert!(owner.park(), "a scribbled word must not block a park");
    b.state.store(0, Ordering::SeqCst);
    assert!(owner.is_parked(), "the owner keeps its own decision");
    assert_eq!(
        owner.wait_while_parked_timeout(Duration::from_millis(5)),
        None
    );
    assert!(owner.unpark());
    assert_eq!(owner.wait_while_parked(), WaitOutcome::Running);
    let mut out = [0u64; 4];
    assert_eq!(owner.read_cpu(&mut out).0, 4, "slots bounded by the caller");
    let mut clamp = CpuClamp::new(4, 1_000, &[0; 4]);
    assert_eq!(clamp.update(11_000, &out), &[10_000; 4]);
    assert!(owner.cpu_is_untrusted());
    owner.shutdown();
    assert!(owner.is_shutdown());
}

#[test]
fn cpu_clamp_is_monotonic_and_bounded_by_wall_time() {
    let g = Gate::new();
    g.publish_cpu(&[5, 7]);
    let mut out = [0u64; 8];
    assert_eq!(g.read_cpu(&mut out), (2, 1));
    assert_eq!(&out[..2], &[5, 7]);
    assert!(!g.cpu_is_untrusted());
    let mut c = CpuClamp::new(2, 0, &[100, 100]);
    assert_eq!(c.update(50, &[120, 90]), &[120, 100], "no going back");
    assert_eq!(
        c.update(60, &[10_000, 105]),
        &[130, 105],
        "at most the wall time"
    );
    assert_eq!(
        c.update(70, &[]),
        &[130, 105],
        "missing figures keep the last"
    );
    assert_eq!(c.total(), 235);
    assert_eq!(c.clamped(), 2);
}
