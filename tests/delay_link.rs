//! The delayed link of the benchmarks (`common/delay.rs`): every chunk crosses one delay late in
//! each direction, in order, and messages sent back to back stay back to back (pipelining is
//! kept: two pipelined requests cost one round trip, not two). Checked against an echo server
//! on loopback, with delays large against a loaded machine's scheduling (a lower bound on a
//! round trip, and pipelined requests well under a delay more than one).

#[path = "common/delay.rs"]
mod delay;

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    thread,
    time::{Duration, Instant},
};

use delay::DelayProxy;

/// An echo server on a free port: its address.
fn echo() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = stream.read(&mut buf) {
                    if n == 0 || stream.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// Reads exactly `n` bytes.
fn read_n(stream: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut got = vec![0u8; n];
    stream.read_exact(&mut got).unwrap();
    got
}

const ONE_WAY: Duration = Duration::from_millis(100);

#[test]
fn a_round_trip_costs_two_delays() {
    let proxy = DelayProxy::start(echo(), ONE_WAY).unwrap();
    let mut link = TcpStream::connect(("127.0.0.1", proxy.port)).unwrap();
    link.set_nodelay(true).unwrap();
    for _ in 0..3 {
        let started = Instant::now();
        link.write_all(b"ping").unwrap();
        assert_eq!(read_n(&mut link, 4), b"ping");
        let took = started.elapsed();
        assert!(took >= 2 * ONE_WAY, "a round trip in {took:?}");
    }
}

#[test]
fn pipelined_messages_cost_one_round_trip_and_keep_their_order() {
    let proxy = DelayProxy::start(echo(), ONE_WAY).unwrap();
    let mut link = TcpStream::connect(("127.0.0.1", proxy.port)).unwrap();
    link.set_nodelay(true).unwrap();
    let started = Instant::now();
    // Two requests, the second sent before the first's reply (and separately, so each is a
    // chunk of its own): both replies are back one round trip later.
    link.write_all(b"first;").unwrap();
    thread::sleep(Duration::from_millis(5));
    link.write_all(b"second;").unwrap();
    let replies = read_n(&mut link, 13);
    let took = started.elapsed();
    assert_eq!(replies, b"first;second;");
    assert!(took >= 2 * ONE_WAY, "{took:?}");
    // One round trip and the 5 ms between the sends: ~205 ms. A link that held the second
    // request until the first had crossed would answer at ~305 ms, one that waited for the
    // first reply at ~405 ms.
    assert!(
        took < 2 * ONE_WAY + ONE_WAY * 2 / 3,
        "pipelined requests took {took:?}: the second waited for the first"
    );
    // Many chunks back to back arrive whole and in order.
    let sent: Vec<u8> = (0..200u32).flat_map(|i| i.to_be_bytes()).collect();
    for chunk in sent.chunks(16) {
        link.write_all(chunk).unwrap();
    }
    assert_eq!(read_n(&mut link, sent.len()), sent);
}

#[test]
fn a_url_is_pointed_at_the_proxy() {
    let proxy = DelayProxy::start(echo(), Duration::ZERO).unwrap();
    let port = proxy.port;
    assert_eq!(
        proxy.url("postgres://postgres@127.0.0.1:5432/test"),
        format!("postgres://postgres@127.0.0.1:{port}/test")
    );
    assert_eq!(
        proxy.url("mysql://root@localhost/test"),
        format!("mysql://root@127.0.0.1:{port}/test")
    );
    assert_eq!(
        delay::target("postgres://u@127.0.0.1:5432/db"),
        "127.0.0.1:5432".parse().unwrap()
    );
}
