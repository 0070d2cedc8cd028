//! A TCP proxy that adds a fixed one-way delay to every chunk in both directions, as a link
//! between two machines does: order and pipelining are kept (a chunk is held for the delay from
//! when it arrived, not from when the one before it left), so two messages sent back to back
//! arrive back to back, one delay later. Plain threads, not tokio: its timer rounds to the
//! millisecond, and a link of 0.25 ms is what users in one zone pay; each chunk is slept for
//! until 200 µs before its time, then spun for.
//!
//! Used by the benchmarks (the floor through a link with latency) and by `tests/delay_link.rs`.
#![allow(dead_code)]

use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

/// A running delay proxy on 127.0.0.1; stops accepting when dropped (open connections end when
/// either side closes).
#[derive(Debug)]
pub struct DelayProxy {
    /// The port it listens on.
    pub port: u16,
    /// The delay it adds each way.
    pub one_way: Duration,
    stop: Arc<AtomicBool>,
}

impl DelayProxy {
    /// Listens on a free port of 127.0.0.1 and forwards each connection to `target`, every
    /// chunk `one_way` late in each direction.
    pub fn start(target: SocketAddr, one_way: Duration) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        thread::Builder::new()
            .name("delay-accept".into())
            .spawn(move || {
                for client in listener.incoming() {
                    if stopping.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(client) = client else { continue };
                    let Ok(server) = TcpStream::connect(target) else {
                        let _ = client.shutdown(Shutdown::Both);
                        continue;
                    };
                    let _ = connect(client, server, one_way);
                }
            })?;
        Ok(Self {
            port,
            one_way,
            stop,
        })
    }

    /// `url` (a database URL) with its host and port replaced by this proxy's.
    pub fn url(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let user = authority
            .rsplit_once('@')
            .map_or(String::new(), |(user, _)| format!("{user}@"));
        format!("{scheme}://{user}127.0.0.1:{}/{path}", self.port)
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accepting thread, which then sees `stop`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

/// The host and port of `url` (a database URL), resolved.
pub fn target(url: &str) -> SocketAddr {
    use std::net::ToSocketAddrs;
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    let host_port = if host_port.contains(':') {
        host_port.to_owned()
    } else if url.starts_with("mysql") {
        format!("{host_port}:3306")
    } else {
        format!("{host_port}:5432")
    };
    host_port
        .to_socket_addrs()
        .expect("resolve")
        .next()
        .expect("an address")
}

/// Forwards `client` ⇄ `server`, each direction by a reader and a writer thread.
fn connect(client: TcpStream, server: TcpStream, one_way: Duration) -> std::io::Result<()> {
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    pipe(client.try_clone()?, server.try_clone()?, one_way)?;
    pipe(server, client, one_way)
}

/// Forwards what `from` sends to `to`, each chunk `one_way` after it arrived.
fn pipe(mut from: TcpStream, mut to: TcpStream, one_way: Duration) -> std::io::Result<()> {
    let (chunks, held) = mpsc::channel::<(Instant, Vec<u8>)>();
    thread::Builder::new()
        .name("delay-read".into())
        .spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if chunks
                            .send((Instant::now() + one_way, buf[..n].to_vec()))
                            .is_err()
                        {
                            break;
                        }
                    }
                }
            }
            // Dropping `chunks` ends the writer once it forwarded what it holds.
        })?;
    thread::Builder::new()
        .name("delay-write".into())
        .spawn(move || {
            for (due, chunk) in held {
                wait_until(due);
                if to.write_all(&chunk).is_err() {
                    break;
                }
            }
            let _ = to.shutdown(Shutdown::Write);
        })?;
    Ok(())
}

/// Sleeps until [`SPIN`] before `due`, then spins to it, yielding the core to whoever else
/// wants it meanwhile (a thread's sleep overshoots by tens of microseconds).
fn wait_until(due: Instant) {
    let now = Instant::now();
    if due > now + SPIN {
        thread::sleep(due - now - SPIN);
    }
    while Instant::now() < due {
        thread::yield_now();
    }
}

/// How long before a chunk's time its writer stops sleeping: Linux wakes a sleeping thread up
/// to its timer slack late (50 µs by default; 55–80 µs measured here), a busy machine later
/// still. Spinning costs a core while it lasts, so the spin yields: with eight connections
/// through a 1 ms link, 200 µs of plain spin per chunk took half of this machine's two cores.
const SPIN: Duration = Duration::from_micros(100);
